"""When training stops itself: a non-finite loss or gradient norm (--check-for-nan-in-loss-and-grad), too many
optimizer steps skipped in a row (--max-consecutive-skipped-steps), or --train-tokens consumed; every rank stops at
the same iteration.
"""
import math

import torch.distributed as dist

from megatron_ds.core import deepspeed_internals
from megatron_ds.launch.runtime import print_rank_0
from megatron_ds.observability.metrics import loss_scale


class NonFiniteTraining(RuntimeError):
    """The loss or gradient norm of an iteration is NaN or Inf (Megatron's --check-for-nan-in-loss-and-grad)."""


def _checks_non_finite(optimization):
    return optimization.check_for_nan_in_loss_and_grad and not optimization.fp16


def grad_norm_to_check(optimization, engine):
    """The gradient norm stop_on_non_finite checks (None where it checks none); optimization: the run's
    OptimizationConfig."""
    return deepspeed_internals.host_global_grad_norm(engine) if _checks_non_finite(optimization) else None


def stop_on_non_finite(optimization, iteration, loss, grad_norm, checkpoints):
    """Every rank sees the same loss (averaged over the replicas) and global gradient norm (the float of
    grad_norm_to_check), so all stop at the same iteration; that iteration is never saved. fp16 is left to
    DeepSpeed's loss scaling, whose skipped steps are normal."""
    if not _checks_non_finite(optimization):
        return
    values = {"lm loss": loss, "grad norm": grad_norm}
    bad = {name: value for name, value in values.items() if value is not None and not math.isfinite(value)}
    if not bad:
        return
    if checkpoints is not None:
        checkpoints.wait_for_saves()  # an earlier save in the background is finite: let it land
    described = ", ".join(f"{name} {value}" for name, value in bad.items())
    raise NonFiniteTraining(f"iteration {iteration}: {described} on rank {dist.get_rank()}; stopping before any "
                            f"save of it (the last checkpoint, if any, is from before). Lower --lr, check the data, "
                            f"or pass --no-check-for-nan-in-loss-and-grad to train on")


class ConsecutiveSkips:
    """Optimizer steps DeepSpeed skipped in a row (a gradient overflow: fp16's dynamic loss scaling, or ZeRO's
    overflow check when the non-finite guard is off). A few are normal in fp16 while the loss scale settles;
    more than `limit` (0: no limit) means training no longer moves."""

    def __init__(self, limit):
        self.limit, self.count = limit, 0

    def after_step(self, applied):
        """Record one step; whether the limit is now exceeded."""
        self.count = 0 if applied else self.count + 1
        return bool(self.limit) and self.count > self.limit


def stop_on_skipped_steps(skipped, engine, iteration, checkpoints):
    """Every rank learns the same overflow (DeepSpeed reduces it), so all stop at the same iteration, unsaved."""
    if not skipped.after_step(engine.was_step_applied()):
        return
    if checkpoints is not None:
        checkpoints.wait_for_saves()
    raise NonFiniteTraining(f"iteration {iteration}: DeepSpeed skipped the optimizer step {skipped.count} times in a "
                            f"row (gradient overflow; loss scale {loss_scale(engine):g}), more than "
                            f"--max-consecutive-skipped-steps {skipped.limit}; stopping before any save of it. Lower "
                            f"--lr, check the data, or raise the limit (0: none)")


def train_tokens_reached(train_tokens, progress):
    """Megatron-DeepSpeed's --train-tokens: no further iteration once that many tokens are consumed (checked
    before each iteration, as its loop condition). Every rank counts the same batches, so all stop together."""
    if train_tokens is None or progress.consumed_train_tokens < train_tokens:
        return False
    print_rank_0(f"--train-tokens {train_tokens} reached: {progress.consumed_train_tokens} tokens "
                 f"consumed at iteration {progress.iteration}")
    return True
