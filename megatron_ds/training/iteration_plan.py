"""What one training iteration runs on, decided once before it starts and handed to everything that needs it:
the engine call (its micro-batches), the LR scheduler (the samples and tokens its step counts) and the logger."""
from dataclasses import dataclass

from megatron_ds.core.parallel_layout import micro_batches_per_step


@dataclass(frozen=True)
class IterationPlan:
    iteration: int
    global_batch_size: int      # samples (the ramp-up's at this point of training)
    micro_batches: int          # per data-parallel rank: the gradient accumulation steps
    seq_length: int             # tokens per sample (the curriculum's at this iteration, else --seq-length)
    consumed_samples: int       # before this iteration
    consumed_tokens: int
    by_curriculum: bool = False  # seq_length comes from the sequence-length curriculum

    @property
    def tokens(self) -> int:
        return self.global_batch_size * self.seq_length


def plan_iteration(iteration, progress, batch_schedule, micro_batch_size, data_parallel_size, seq_length,
                   by_curriculum=False) -> IterationPlan:
    """The plan of `iteration` from the TrainingProgress before it."""
    global_batch_size = batch_schedule.global_batch_size(progress.consumed_train_samples)
    return IterationPlan(iteration, global_batch_size,
                         micro_batches_per_step(global_batch_size, micro_batch_size, data_parallel_size), seq_length,
                         progress.consumed_train_samples, progress.consumed_train_tokens, by_curriculum)
