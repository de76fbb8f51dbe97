"""tools/dry_run.py: a launch checked on this machine before it is queued, its ranks run on torch's fake process
group. The one part of the project that may import training (it runs the start-up and an iteration of it).

    launch_check.py        the command: flags resolved and checked, ranks chosen and run, the report
    fake_rank.py           a rank's start-up (and iteration) in a process of its own, on the fake process group
    fake_step.py           one training iteration of a dry-run rank: its ops, collectives and memory peak
    step_checks.py         the checks across ranks of the iterations they ran
    collective_devices.py  collectives on CPU tensors, which NCCL refuses, recorded from a CPU run
"""
