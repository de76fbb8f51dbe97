"""megatron_ds: Megatron's tensor- and sequence-parallel layers and fused kernels inside DeepSpeed's engine.

Packages, lowest first. Each imports only from itself and the packages listed before it, at the top of its
modules (tests/unit/test_house.py holds this order, docs/architecture.md explains it):

    core/             the library (like megatron.core): parallel state, layers, transformer, fused ops, schedules
    data/             datasets, samplers, tokenizers: the flags' data to each rank's micro-batches
    launch/           the process and the machine: the launcher's word, start-up, devices, watchdog, storage
    observability/    what a run reports: the log, throughput, profiles, the pipeline timeline, compile costs
    checkpointing/    the checkpoint format, saves and loads, and the formats of other programs
    engine/           our model inside DeepSpeed's engine: its JSON, mpu, schedules and mends
    arguments/        pretrain.py's command line -> one resolved, validated, read-only configuration
    planning/         the formulas and the planner (tools/plan.py)
    inference/        generation from a checkpoint
    conversion/       checkpoint conversions: reshaping, Hugging Face, Megatron-DeepSpeed
    training/         pretrain(): start-up, the loop, the optimizer, distillation, resilience
    planning/dry_run/ tools/dry_run.py: the start-up and an iteration on a fake process group; it imports training
"""
