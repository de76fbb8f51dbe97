"""Our model inside DeepSpeed's engine: its configuration, its mpu, its schedules and what we mend in it.

    ds_config.py                 Megatron flags <-> DeepSpeed JSON
    deepspeed_keys.py            the keys a DeepSpeed JSON may hold
    mpu.py                       the mpu DeepSpeed's plain engine (PP = 1) expects, served by core.parallel_state
    deepspeed_schedules.py       ZB-H1, the zero-bubble DualPipeV and interleaved 1F1B in DeepSpeed's pipeline engines
    gradient_reduction.py        data-parallel gradient reduction for DeepSpeed's BF16_Optimizer
    activation_checkpointing.py  DeepSpeed's activation checkpointing configured with our mpu
    curriculum.py                the DeepSpeed JSON's legacy sequence-length curriculum
    moe_token_gather.py          DeepSpeed's MoE token split over TP ranks, mended
"""
