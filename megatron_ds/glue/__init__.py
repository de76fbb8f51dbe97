"""Glue between Megatron-style runs and the process, the launcher and DeepSpeed's engine.

    launcher_env.py          what the launcher that started this process says (rank, sizes, restarts)
    runtime.py               process start-up: CPU or GPU, threads per rank, the distributed backend, each rank's GPU
    cpu_features.py          this CPU's model and 16-bit matrix extensions; the start-up warning where a run lacks them
    watchdog.py              hang safety: a rank that raises, dies or hangs makes every rank exit in bounded time
    storage.py               start-up checks of the folders a run writes
    topology.py              where the parallel groups land on the hardware (--print-topology)
    ds_config.py             Megatron flags <-> DeepSpeed JSON; deepspeed_keys.py: the keys a DeepSpeed JSON may hold
    mpu.py                   the mpu DeepSpeed's plain engine (PP = 1) expects, served by core.parallel_state
    gradient_reduction.py    data-parallel gradient reduction for DeepSpeed's BF16_Optimizer
    activation_checkpointing.py  DeepSpeed's activation checkpointing configured with our mpu
    pipeline_schedules.py    ZB-H1 and the zero-bubble DualPipeV in DeepSpeed's pipeline engines
    interleaved_pipeline.py  Megatron's interleaved 1F1B on DeepSpeed's DualPipeV machinery
    curriculum.py            the DeepSpeed JSON's legacy sequence-length curriculum
    moe_token_gather.py      DeepSpeed's MoE token split over TP ranks, mended
"""
