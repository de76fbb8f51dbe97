"""--rerun-mode validate_results: tell a device's transient fault from a result the data or the model really gives,
by computing the iteration again (Megatron-Core's rerun state machine, its flags, modes and exit codes).

Every iteration's optimizer step is held until its loss has been validated (finite with
--check-for-nan-in-loss-and-grad, and with --check-for-spiky-loss at most --spiky-loss-factor x the largest loss
of the last SPIKE_WINDOW iterations). When a validation fails, the step is dropped and the iteration computed
again from the same state: the same weights (the step was never taken), the same data (the iterator rebuilt at
the iteration's first sample) and the same random numbers (every generator restored). Then
- the replay differs: a transient fault; the ranks whose loss changed are named and the run exits with
  EXIT_RESUME_ELSEWHERE (16) without saving the iteration: the next launch resumes from the last checkpoint;
- the replay gives the same failing result: it is the data's or the model's; the run exits with
  EXIT_FAILED_VALIDATION (17) naming the iteration, the global batch's samples and documents and the loss, or with
  --skip-spiky-batches (a spike, not a NaN) drops the batch, says so and trains on;
- the replay gives the same result and it passes: the check fired by mistake (only an injected correct_result
  does that), the replay's step is taken.
Not done: replaying a reproduced result once more on other devices (Megatron-Core restarts the job on other
nodes for it); the message says the result reproduced on the same ranks.

--error-injection-rate N fails every Nth validation on purpose (--error-injection-type): transient_error makes
the last rank's loss NaN (or a spike, where only the spike check is on) in the first computation only,
persistent_error in the replay too, correct_result fails the check with the true value.
"""
import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.checkpointing.rng import collect_rng_state, restore_rng_state
from megatron_ds.core.deepspeed_internals import DeferredOptimizerStep
from megatron_ds.glue.runtime import device, print_rank_0

EXIT_RESUME_ELSEWHERE = 16     # Megatron-Core's EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_FAILED_VALIDATION = 17    # Megatron-Core's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
SPIKE_WINDOW = 100


class RerunExit(RuntimeError):
    """Stop the run with exit_code, after the message."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Validation:
    check_nan: bool
    check_spike: bool
    spiky_loss_factor: float
    injection_rate: int
    injection_type: str
    skip_spiky_batches: bool

    @classmethod
    def from_args(cls, args):
        return cls(check_nan=args.check_for_nan_in_loss_and_grad and not args.fp16,
                   check_spike=args.check_for_spiky_loss, spiky_loss_factor=args.spiky_loss_factor,
                   injection_rate=args.error_injection_rate, injection_type=args.error_injection_type,
                   skip_spiky_batches=args.skip_spiky_batches)


class ResultValidator:
    """One per run; run_iteration(compute) replaces a plain compute() of a training iteration."""

    def __init__(self, validation, engine):
        self.validation, self.engine = validation, engine
        self.recent = []            # the losses of the last SPIKE_WINDOW accepted iterations
        self.validations = 0

    def run_iteration(self, iteration, compute, rewind, describe_batch):
        """compute(): (loss, extra) of one global batch, the loss equal on every rank; rewind(): put the data
        iterator back at the iteration's first sample; describe_batch(): its samples, for a message. Returns
        (loss, extra, whether the batch was skipped)."""
        rng = collect_rng_state()
        self.validations += 1
        injected = self._injection()
        with DeferredOptimizerStep(self.engine) as step:
            loss, extra = compute()
            first = self._seen(loss, injected, replay=False)
            problem = self._agreed_problem(first, injected)
            if problem is None:
                step.apply()
                self._accept(loss)
                return loss, extra, False
            step.discard()
            restore_rng_state(rng)
            rewind()
            loss, extra = compute()
            firsts, replays = _gather(first), _gather(self._seen(loss, injected, replay=True))
            changed = [rank for rank, (a, b) in enumerate(zip(firsts, replays)) if _bits(a) != _bits(b)]
            if changed:
                step.discard()
                raise RerunExit(self._transient(iteration, problem, firsts, replays, changed), EXIT_RESUME_ELSEWHERE)
            still = next(filter(None, (self._problem(value, None) for value in replays)), None)
            if still is None:  # a false alarm: the check fired on a good result
                print_rank_0(f"iteration {iteration}: {problem}; computed again: the same loss {loss!r}, which "
                             f"passes the check: training on with it")
                step.apply()
                self._accept(loss)
                return loss, extra, False
            step.discard()
            if still.startswith("spike") and self.validation.skip_spiky_batches:
                print_rank_0(f"WARNING: iteration {iteration}: {still}, reproduced when computed again; "
                             f"--skip-spiky-batches: skipping the batch ({describe_batch()}), no optimizer step")
                return loss, extra, True
            value = next(value for value in replays if self._problem(value, None))
            raise RerunExit(f"iteration {iteration}: {still}, reproduced when computed again on the same ranks (loss "
                            f"{value!r} both times): the data's or the model's, not a device's. The global batch: "
                            f"{describe_batch()}. Not saved; the last checkpoint is from before",
                            EXIT_FAILED_VALIDATION)

    def _injection(self):
        """Whether this validation is one --error-injection-rate fails (the same decision on every rank)."""
        rate = self.validation.injection_rate
        return bool(rate) and self.validations % rate == 0

    def _seen(self, loss, injected, replay):
        """The loss this rank judges: the true one, or on the last rank an injected error's value."""
        kind = self.validation.injection_type
        corrupt = (injected and kind != "correct_result" and (not replay or kind == "persistent_error")
                   and dist.get_rank() == dist.get_world_size() - 1)
        if not corrupt:
            return loss
        return float("nan") if self.validation.check_nan else loss * self.validation.spiky_loss_factor * 10

    def _agreed_problem(self, loss, injected):
        """_problem, decided the same on every rank: every rank judges the same loss unless an error is injected
        into one, so only then is the world asked (one MAX all-reduce of a flag)."""
        reason = self._problem(loss, injected)
        if not self.validation.injection_rate:
            return reason
        flag = torch.tensor([1.0 if reason else 0.0], device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return (reason or f"rank {dist.get_world_size() - 1}'s loss failed validation") if flag.item() else None

    def _problem(self, loss, injected):
        """Why the loss fails validation, else None."""
        if self.validation.check_nan and not math.isfinite(loss):
            return f"the loss is {loss}"
        if self.validation.check_spike and self.recent and loss > self.validation.spiky_loss_factor * max(self.recent):
            return (f"spike: lm loss {loss:.6g} is more than {self.validation.spiky_loss_factor:g}x the largest of "
                    f"the last {len(self.recent)} iterations ({max(self.recent):.6g})")
        if injected and self.validation.injection_type == "correct_result":
            return "an injected false alarm (--error-injection-type correct_result)"
        return None

    @staticmethod
    def _transient(iteration, problem, firsts, replays, changed):
        """The message for a result that did not reproduce, naming the ranks whose loss changed."""
        values = "; ".join(f"rank {rank}: {firsts[rank]!r}, then {replays[rank]!r}" for rank in changed)
        return (f"iteration {iteration}: {problem}; computed again from the same state, the loss changed on rank(s) "
                f"{', '.join(map(str, changed))} ({values}): a transient fault of the device(s) of those rank(s). "
                f"Not saved; exiting with {EXIT_RESUME_ELSEWHERE} so that the job is resumed from the last "
                f"checkpoint (on other nodes where the scheduler can)")

    def _accept(self, loss):
        self.recent = (self.recent + [loss])[-SPIKE_WINDOW:]


def _gather(value):
    """Every rank's value, in rank order."""
    local = torch.tensor([value], dtype=torch.float64, device=device())
    values = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(values, local)
    return [float(value.item()) for value in values]


def _bits(value):
    return struct.pack("<d", value)
