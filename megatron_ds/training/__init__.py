"""Training: pretrain.py's run from the command line to its exit status.

    entry.py           pretrain(): checks before any collective, start-up, load, train, the exit status
    initialize.py      start_up(): parallel groups, seeding, the model inside its engine, the start-up log
    model_setup.py     the model (GPTModel or a PipelineModule), optimizer and scheduler inside DeepSpeed's engine
    loop.py            the training loop and evaluation: one global batch per iteration through the engine
    observers.py       what watches each iteration (timeline, profiler, compile cost, reproducibility, stragglers)
    stopping.py        when training stops itself: non-finite loss or gradient norm, too many skipped steps
    iteration_plan.py  what one iteration runs on (batch size, micro-batches, tokens), decided before it starts
    optimizer.py       the optimizer: AdamW or SGD, DeepSpeed's fused or CPU Adam where they apply
    distillation.py    knowledge distillation (--kd): the frozen teacher beside the student, the KD loss
    resilience/        faults told from results (rerun.py) and slow ranks found (stragglers.py)
"""
from megatron_ds.training.entry import pretrain

__all__ = ["pretrain"]
