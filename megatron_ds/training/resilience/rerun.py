"""--rerun-mode validate_results: tell a device's transient fault from a result the data or the model really gives,
by computing the iteration again (Megatron-Core's rerun state machine, its flags, modes and exit codes).

Every iteration's optimizer step is held until its loss has been validated (finite with
--check-for-nan-in-loss-and-grad, and with --check-for-spiky-loss at most --spiky-loss-factor x the largest loss
of the last SPIKE_WINDOW iterations) and, with --check-for-nan-in-loss-and-grad, its reduced gradients too (finite,
as each rank's optimizer holds its share: a fault in the backward pass does not show in the loss). When a
validation fails, the step is dropped and the iteration computed again from the same state: the same weights (the
step was never taken), the same data (the iterator rebuilt at the iteration's first sample) and the same random
numbers (every generator restored). Then
- the replay differs: a transient fault; the ranks that computed it are named (those whose stage output changed
  at the earliest pipeline stage where any did, else those whose own parameter gradients, summed as backward
  computes them, changed at the last stage where any did, else those whose loss changed) and the run exits with
  EXIT_RESUME_ELSEWHERE (16) without saving the iteration: the next launch resumes from the last checkpoint;
- the replay gives the same failing result on the same ranks: the data's, the model's or a persistent fault of a
  device. Where the layout has another data-parallel replica (and no experts), the iteration is computed a third
  time from the same state with the micro-batches moved one replica on (each rank computes those of the rank at
  its place in the next replica, which holds the same weights): where every rank's stage output then equals what
  the batch's own rank computed, the result is the data's or the model's; where one differs, the fault stayed
  with a device: its ranks are named and the run exits 16 (Megatron-Core restarts the job on other nodes and
  computes the iteration there; this needs no restart). A result that is the data's or the model's (or that
  the layout cannot move) exits EXIT_FAILED_VALIDATION (17) naming the iteration, the global batch's samples and
  documents and the loss, or with --skip-spiky-batches (a spike, not a NaN) drops the batch, says so and trains on;
- the replay gives the same result and it passes: the check fired by mistake (only an injected correct_result
  does that), the replay's step is taken.

--error-injection-rate N fails every Nth validation on purpose (--error-injection-type): transient_error makes
the last rank's loss NaN (or a spike, where only the spike check is on) in the first computation only,
persistent_error in every computation on that rank (its output too, for the comparison across replicas: a fault
of its device), correct_result fails the check with the true value.

--rerun-mode report_stats: every --rerun-stats-interval-th iteration is computed twice from the same state (the
first computation's step dropped, the second's taken) and compared rank by rank, loss and stage output; every log
interval and at the end the run prints how many reproduced bit for bit, the largest relative loss difference
and the ranks whose results moved. Nothing stops the run: it measures how reproducible the devices and kernels
are (an injected transient_error shows as the last rank's loss moving).
"""
import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ds.checkpointing.rng import collect_rng_state, restore_rng_state
from megatron_ds.core import parallel_state
from megatron_ds.core.deepspeed_internals import DeferredOptimizerStep, held_gradients
from megatron_ds.launch.runtime import device, print_rank_0

EXIT_RESUME_ELSEWHERE = 16     # Megatron-Core's EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_FAILED_VALIDATION = 17    # Megatron-Core's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
SPIKE_WINDOW = 100
GRADIENTS_NOT_FINITE = "the gradients hold a NaN or Inf (the loss passes)"


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
    no_other_replica: str = None   # why a reproduced result cannot be computed on other devices; None: it can

    @classmethod
    def from_config(cls, rerun):
        """From the run's RerunConfig (arguments/configs.py)."""
        return cls(check_nan=rerun.check_for_nan_in_loss_and_grad and not rerun.fp16,
                   check_spike=rerun.check_for_spiky_loss, spiky_loss_factor=rerun.spiky_loss_factor,
                   injection_rate=rerun.error_injection_rate, injection_type=rerun.error_injection_type,
                   skip_spiky_batches=rerun.skip_spiky_batches, no_other_replica=_no_other_replica(rerun))


def _no_other_replica(rerun):
    if rerun.data_parallel_size == 1:
        return "one data-parallel replica: no other devices hold the same weights"
    if rerun.moe:
        return "an MoE model: experts on other ranks compute its tokens whichever replica reads them"
    return None


class ResultValidator:
    """One per run; run_iteration(compute) replaces a plain compute() of a training iteration."""

    def __init__(self, validation, engine):
        self.validation, self.engine = validation, engine
        self.recent = []            # the losses of the last SPIKE_WINDOW accepted iterations
        self.validations = 0
        self.prints = _Fingerprint(engine.module)

    def run_iteration(self, iteration, compute, batch):
        """compute(): (loss, extra) of one global batch, the loss equal on every rank; batch: the iteration's
        global batch (rewind(replicas_over=0), pass_over(), describe(): training._IterationBatch). Returns (loss,
        extra, whether the batch was skipped)."""
        rng, injected = collect_rng_state(), self._injection()
        with DeferredOptimizerStep(self.engine) as step:
            loss, extra, first_prints = self._computed(compute)
            first = self._seen(loss, injected, replay=False)
            problem = self._agreed_problem(first, injected)
            if problem is None:
                step.apply()
                self._accept(loss)
                return loss, extra, False
            step.discard()
            loss, extra, prints = self._computed_again(compute, rng, batch.rewind)
            gradients_again = self._agreed_failures(None)[1]
            ranks = _gather_ranks(first, first_prints, self._seen(loss, injected, replay=True), prints)
            if any(rank.changed for rank in ranks):
                step.discard()
                raise RerunExit(self._transient(iteration, problem, ranks), EXIT_RESUME_ELSEWHERE)
            value, still = self._still_failing(ranks, loss, gradients_again)
            if still is None:  # a false alarm: the check fired on a good result
                print_rank_0(f"iteration {iteration}: {problem}; computed again: the same loss {loss!r}, which "
                             f"passes the check: training on with it")
                step.apply()
                self._accept(loss)
                return loss, extra, False
            step.discard()
            where = self._reproduced_where(iteration, compute, (rng, batch), injected, first_prints, (still, value))
            step.discard()
            if still.startswith("spike") and self.validation.skip_spiky_batches:
                print_rank_0(f"WARNING: iteration {iteration}: {still}, reproduced when computed again {where}; "
                             f"--skip-spiky-batches: skipping the batch ({batch.describe()}), no optimizer step")
                return loss, extra, True
            raise RerunExit(f"iteration {iteration}: {still}, reproduced when computed again {where}. The global "
                            f"batch: {batch.describe()}. Not saved; the last checkpoint is from before",
                            EXIT_FAILED_VALIDATION)

    def _still_failing(self, ranks, loss, gradients_again):
        """(value, why) of a replay that reproduced the first computation: why it still fails, else None."""
        for value in (rank.replay_loss for rank in ranks):
            reason = self._problem(value, None)
            if reason:
                return value, reason
        return loss, GRADIENTS_NOT_FINITE if gradients_again else None

    def _reproduced_where(self, iteration, compute, start, injected, first_prints, failure):
        """Where a failing result reproduced, for the message (the same value on the same ranks, and where the
        layout allows on the next data-parallel replica's devices: each rank given the micro-batches of the rank
        at its place in the next replica, from the same state). A result that moves with those devices is a
        persistent fault of one of them: RerunExit(16) naming it. start: (RNG state, batch) of the iteration;
        failure: (why, value) of the reproduced result."""
        (rng, batch), (why, value) = start, failure
        same = f"on the same ranks (loss {value!r} both times)"
        if self.validation.no_other_replica:
            return (f"{same}: the data's or the model's, or a persistent fault of a device, which this layout cannot "
                    f"tell apart ({self.validation.no_other_replica})")
        restore_rng_state(rng)
        batch.rewind(replicas_over=1)
        _, _, prints = self._computed(compute)
        batch.pass_over()
        pairs = _gather_replica_pairs(self._seen_prints(first_prints, injected, replay=False),
                                      self._seen_prints(prints, injected, replay=True))
        if any(pair.changed for pair in pairs):
            raise RerunExit(_persistent(iteration, why, pairs), EXIT_RESUME_ELSEWHERE)
        return f"{same} and on the next data-parallel replica's devices: the data's or the model's, not a device's"

    def _computed(self, compute):
        """(loss, extra, this rank's fingerprints) of one computation of the global batch."""
        self.prints.reset()
        loss, extra = compute()
        return loss, extra, self.prints.read()

    def _computed_again(self, compute, rng, rewind):
        """_computed from the iteration's starting state: every generator restored, the data set back."""
        restore_rng_state(rng)
        rewind()
        return self._computed(compute)

    def _injection(self):
        """Counts a validation; whether it is one --error-injection-rate fails (the same decision on every rank)."""
        self.validations += 1
        rate = self.validation.injection_rate
        return bool(rate) and self.validations % rate == 0

    def _seen(self, loss, injected, replay):
        """The loss this rank judges: the true one, or on the last rank an injected error's value."""
        if not self._corrupts(injected, replay):
            return loss
        return float("nan") if self.validation.check_nan else loss * self.validation.spiky_loss_factor * 10

    def _seen_prints(self, prints, injected, replay):
        """This rank's fingerprints as the comparison across replicas sees them: an injected error that corrupts
        the last rank's loss corrupts its output and gradients too (a persistent one on every computation: a fault
        of its device, whichever data it computes)."""
        return torch.full_like(prints, float("nan")) if self._corrupts(injected, replay) else prints

    def _corrupts(self, injected, replay):
        """Whether an injected error corrupts this rank's result (the last rank's; a transient error in the first
        computation only)."""
        kind = self.validation.injection_type
        return (injected and kind != "correct_result" and (not replay or kind == "persistent_error")
                and dist.get_rank() == dist.get_world_size() - 1)

    def _agreed_problem(self, loss, injected):
        """_problem, else GRADIENTS_NOT_FINITE, decided the same on every rank."""
        reason = self._problem(loss, injected)
        loss_failed, gradients_failed = self._agreed_failures(reason)
        if loss_failed:
            return reason or f"rank {dist.get_world_size() - 1}'s loss failed validation"
        return GRADIENTS_NOT_FINITE if gradients_failed else None

    def _agreed_failures(self, reason):
        """(whether any rank's loss failed, whether any rank holds a gradient that is not finite): every rank
        judges the same loss unless an error is injected into one, and each holds its share of the reduced
        gradients, so the world is asked (one MAX all-reduce of two flags) when either can differ."""
        checks_gradients = self.validation.check_nan
        if not (self.validation.injection_rate or checks_gradients):
            return reason is not None, False
        flags = torch.tensor([float(reason is not None), float(checks_gradients and not self._gradients_finite())],
                             device=device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss_failed, gradients_failed = flags.tolist()
        return bool(loss_failed), bool(gradients_failed)

    def _gradients_finite(self):
        """Whether this rank's share of the gradients the held step would apply is finite (one sum: a NaN or Inf
        anywhere makes it so; CPU offload's are not looked at)."""
        gradients = held_gradients(self.engine)
        if not gradients:
            return True
        return bool(torch.isfinite(torch.stack([grad.sum(dtype=torch.float64) for grad in gradients]).sum()))

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
    def _transient(iteration, problem, ranks):
        """The message for a result that did not reproduce, naming the ranks that computed it (_culprits)."""
        culprits, how = _culprits(ranks)
        return (f"iteration {iteration}: {problem}; computed again from the same state, {how}: a transient fault of "
                f"the device(s) of rank(s) {_numbers(culprits)}. Not saved; exiting with {EXIT_RESUME_ELSEWHERE} so "
                f"that the job is resumed from the last checkpoint (on other nodes where the scheduler can)")

    def _accept(self, loss):
        self.recent = (self.recent + [loss])[-SPIKE_WINDOW:]


class ReproducibilityStats(ResultValidator):
    """--rerun-mode report_stats: run_iteration computes every interval-th iteration twice and keeps the
    statistics that report() prints."""

    def __init__(self, validation, engine, interval):
        super().__init__(validation, engine)
        self.interval = interval
        self.checked = self.reproduced = 0
        self.largest = (0.0, None)    # (relative loss difference, iteration)
        self.moved = {}               # rank -> iterations where a result it computed did not reproduce (_culprits)

    def run_iteration(self, iteration, compute, batch):
        """As ResultValidator.run_iteration, never skipping: (loss, extra, False)."""
        if iteration % self.interval:
            loss, extra = compute()
            return loss, extra, False
        rng, injected = collect_rng_state(), self._injection()
        with DeferredOptimizerStep(self.engine) as step:
            first_loss, _, first_prints = self._computed(compute)
            step.discard()
            loss, extra, prints = self._computed_again(compute, rng, batch.rewind)
            self._record(iteration, _gather_ranks(self._seen(first_loss, injected, replay=False), first_prints,
                                                  self._seen(loss, injected, replay=True), prints))
            step.apply()
        return loss, extra, False

    def _record(self, iteration, ranks):
        self.checked += 1
        moved = _culprits(ranks)[0] if any(rank.changed for rank in ranks) else []
        self.reproduced += not moved
        for rank in moved:
            self.moved.setdefault(rank.number, []).append(iteration)
        differences = [_relative_difference(rank.first_loss, rank.replay_loss) for rank in ranks]
        difference = next((value for value in differences if math.isnan(value)), max(differences))
        if not math.isnan(self.largest[0]) and (math.isnan(difference) or difference > self.largest[0]):
            self.largest = (difference, iteration)  # a NaN stays the largest

    def report(self, iteration):
        """The statistics so far, one line."""
        if not self.checked:
            return f"rerun stats to iteration {iteration}: no iteration computed twice yet"
        difference, at = self.largest
        largest = f"{difference:.3g} (iteration {at})" if at is not None else "0"
        moved = "; ".join(f"rank {rank} at iteration(s) {', '.join(map(str, its))}"
                          for rank, its in sorted(self.moved.items())) or "none"
        return (f"rerun stats to iteration {iteration}: {self.reproduced} of {self.checked} iterations computed "
                f"twice reproduced bit for bit; largest relative loss difference {largest}; results moved on: {moved}")


def _culprits(ranks):
    """(ranks, how) that computed a result which did not reproduce: those whose own output (gradients) changed at
    the first pipeline stage in the forward (backward) order where any did (the stages after it computed on what
    they received), else those whose loss changed."""
    changed = _first_change(ranks)
    if changed:
        stage, what, culprits = changed
        return culprits, (f"the {what} of pipeline stage {stage} changed on rank(s) {_numbers(culprits)} (the ranks "
                          f"{'downstream' if what == 'output' else 'upstream'} of it computed on what they received)")
    culprits = [rank for rank in ranks if rank.loss_changed]
    return culprits, "the loss changed on rank(s) " + "; ".join(
        f"{rank.number}: {rank.first_loss!r}, then {rank.replay_loss!r}" for rank in culprits)


def _first_change(results):
    """(stage, "output" or "gradients", the results there that changed) at the earliest stage whose output
    changed, else the last stage whose gradients changed (backward runs from the last stage); None if neither."""
    for what, changed, first in (("output", "output_changed", min), ("gradients", "gradients_changed", max)):
        moved = [result for result in results if getattr(result, changed)]
        if moved:
            stage = first(result.stage for result in moved)
            return stage, what, [result for result in moved if result.stage == stage]
    return None


def _persistent(iteration, why, pairs):
    """The message for a result that reproduced on the same ranks but changed on the next data-parallel replica's
    devices, naming the device(s) it stayed with (_persistent_culprits)."""
    culprits, how = _persistent_culprits(pairs)
    return (f"iteration {iteration}: {why}, reproduced when computed again on the same ranks; computed on the next "
            f"data-parallel replica's devices, {how}: a persistent fault of the device(s) of rank(s) "
            f"{', '.join(map(str, culprits))}. Not saved; exiting with {EXIT_RESUME_ELSEWHERE} so that the job is "
            f"resumed from the last checkpoint without those devices")


def _persistent_culprits(pairs):
    """(ranks, how): at the stage where the first change shows (_first_change: a rank's output or gradients
    differing from what the rank at its place in the next replica had computed from the same micro-batches), the
    replicas common to every such pair; where two remain (two replicas), the one whose results were not finite both
    times."""
    stage, what, at_stage = _first_change(pairs)
    replicas = set.intersection(*({pair.replica, pair.source_replica} for pair in at_stage))
    stayed = {pair.replica for pair in at_stage if pair.replica in replicas and pair.not_finite_both_times}
    replicas = stayed or replicas
    culprits = sorted(pair.number for pair in pairs if pair.stage == stage and pair.replica in replicas)
    moved = ", ".join(f"{pair.number} (computing rank {pair.source}'s micro-batches)" for pair in at_stage)
    return culprits, f"the {what} of pipeline stage {stage} changed on rank(s) {moved}"


def _relative_difference(first, replay):
    if _bits(first) == _bits(replay):
        return 0.0
    if not (math.isfinite(first) and math.isfinite(replay)):
        return float("nan")
    return abs(replay - first) / max(abs(first), 1e-30)


class _Fingerprint:
    """Two sums of what this rank computes in an iteration, kept on the device (no synchronization per
    micro-batch): everything its model (its pipeline stage) outputs, and every parameter gradient its backward
    computes, as computed (before any accumulation or reduction). Each hook only appends its tensor's sum."""

    def __init__(self, module):
        self.outputs, self.gradients, self.hooks = [], [], []
        self.attach(module)

    def attach(self, module):
        self.hooks.append(module.register_forward_hook(self._add_output))
        self.hooks.extend(param.register_hook(self._add_gradient) for param in module.parameters()
                          if param.requires_grad)

    def detach(self):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def _add_output(self, module, inputs, output):
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if torch.is_tensor(tensor) and tensor.is_floating_point():
            self.outputs.append(tensor.detach().sum(dtype=torch.float64))

    def _add_gradient(self, gradient):
        self.gradients.append(gradient.detach().sum(dtype=torch.float32))

    def reset(self):
        self.outputs, self.gradients = [], []

    def read(self):
        """tensor([output sum, gradient sum]), float64, on the device."""
        zero = torch.zeros((), dtype=torch.float64, device=device())
        return torch.stack([torch.stack(sums).sum(dtype=torch.float64) if sums else zero
                            for sums in (self.outputs, self.gradients)])


@dataclass(frozen=True)
class _RankResult:
    number: int
    stage: int
    first_loss: float
    replay_loss: float
    first_output: float
    first_gradients: float
    replay_output: float
    replay_gradients: float

    @property
    def loss_changed(self):
        return _bits(self.first_loss) != _bits(self.replay_loss)

    @property
    def output_changed(self):
        return _bits(self.first_output) != _bits(self.replay_output)

    @property
    def gradients_changed(self):
        return _bits(self.first_gradients) != _bits(self.replay_gradients)

    @property
    def changed(self):
        return self.loss_changed or self.output_changed or self.gradients_changed


def _gather_ranks(first_loss, first_prints, replay_loss, replay_prints):
    """Every rank's losses and fingerprints of both computations, in rank order (one all-gather)."""
    rows = _all_gather_rows([parallel_state.get_pipeline_model_parallel_rank(), first_loss, replay_loss],
                            first_prints, replay_prints)
    return [_RankResult(number, int(row[0]), *row[1:]) for number, row in enumerate(rows)]


def _all_gather_rows(values, *tensors):
    """Every rank's row (its values, then its float64 tensors), as lists in rank order: one all-gather."""
    local = torch.cat([torch.tensor(values, dtype=torch.float64, device=device()), *tensors])
    rows = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return [row.tolist() for row in rows]


@dataclass(frozen=True)
class _ReplicaPair:
    """A rank's fingerprints (output, gradients) computed from the micro-batches of the rank at its place in the
    next data-parallel replica (`source`), beside what that rank had computed from them, and its own first ones."""
    number: int
    stage: int
    replica: int
    source: int
    source_replica: int
    own_first: tuple
    source_first: tuple
    shifted: tuple

    @property
    def output_changed(self):
        return _bits(self.source_first[0]) != _bits(self.shifted[0])

    @property
    def gradients_changed(self):
        return _bits(self.source_first[1]) != _bits(self.shifted[1])

    @property
    def changed(self):
        return self.output_changed or self.gradients_changed

    @property
    def not_finite_both_times(self):
        return not (all(map(math.isfinite, self.own_first)) or all(map(math.isfinite, self.shifted)))


def _gather_replica_pairs(first_prints, shifted_prints):
    """Every rank's _ReplicaPair (one all-gather)."""
    replicas = parallel_state.get_data_parallel_ranks()
    replica = parallel_state.get_data_parallel_rank()
    source = replicas[(replica + 1) % len(replicas)]
    rows = _all_gather_rows([parallel_state.get_pipeline_model_parallel_rank(), replica, source], first_prints,
                            shifted_prints)
    replica_of = {number: int(row[1]) for number, row in enumerate(rows)}
    return [_ReplicaPair(number, int(row[0]), int(row[1]), int(row[2]), replica_of[int(row[2])], tuple(row[3:5]),
                         tuple(rows[int(row[2])][3:5]), tuple(row[5:7]))
            for number, row in enumerate(rows)]


def _numbers(ranks):
    return ", ".join(str(rank.number) for rank in ranks)


def _bits(value):
    return struct.pack("<d", value)
