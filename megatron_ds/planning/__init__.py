"""3D-parallel planning (tools/plan.py): exact parameter counts, memory per device, FLOPs, communication
volume and an estimated iteration time for a model on a cluster, with a search over layouts.

    model.py           ModelSpec (the model), Layout (tp, Ulysses, CP, pp, dp, batch, SP, recompute), Cluster
    from_flags.py      a run's flags as a ModelSpec and a Layout; the memory pretrain.py prints beside its measured
    parameters.py      exact parameter counts per stage and device; MoE: total and active, E/EP experts per rank
    memory.py          weights, gradients, ZeRO-1 optimizer shard (over Ulysses x CP x DP; experts' over TP x DP /
                       EP), activations per pipeline stage (/ Ulysses x CP)
    hardware_flops.py  model and hardware FLOPs per iteration
    communication.py   bytes per axis (TP collectives, Ulysses and MoE all-to-alls, the CP ring, PP sends, DP
                       reduction) and their links
    pipeline.py        the pipeline schedule's time and bubble
    performance.py     the time model and its assumptions
    checkpoints.py     what a checkpoint costs and how often to write one
    planner.py         one layout -> a JSON-ready plan
    search.py          every layout, ranked (Ulysses and CP where a layout needs them)
    meta.py            stages built on the meta device with the real model code, checked against the formulas
    report.py          plain-text rendering of a plan, a search and a meta check
    plan_cli.py        tools/plan.py's flags and output
    dry_run/           tools/dry_run.py: the launch's ranks on a fake process group (it alone imports training)
"""
