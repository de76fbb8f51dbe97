"""The library, as megatron.core is Megatron-LM's: it imports nothing else of megatron_ds.

    parallel_layout.py         ParallelLayout: the parallel degrees of a run and every rule they obey
    parallel_state.py          TP / SP / CP / PP / DP (and expert) process groups on DeepSpeed's topology
    sequence_split.py          which tokens of a sample each rank holds under Ulysses SP and context parallelism
    pipeline_schedules.py      the pipeline schedules as each rank's order of work, and their simulation
    pipeline_split.py          which layers each pipeline stage holds: even, or Megatron-LM's uneven split
    batch_schedule.py          Megatron's batch-size ramp-up (--rampup-batch-size)
    optimizer_param_scheduler.py  Megatron's learning-rate schedule, counted in iterations, samples or tokens
    deepspeed_internals/       the one door into DeepSpeed's private members
    tensor_parallel/           tensor-parallel layers, communication, RNG and vocab-parallel losses
    transformer/               the transformer layer: attention, MLP, MoE, norms, rotary, its config
    fusions/                   fused ops with plain-PyTorch references, Triton kernels, compile and apex paths
    models/                    models built from the layers (GPT)
"""
