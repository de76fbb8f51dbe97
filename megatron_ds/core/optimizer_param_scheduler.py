"""Megatron's learning-rate schedule, counted in iterations, samples or tokens.

Linear warmup from 0 to --lr, then constant, linear or cosine decay to --min-lr. Each phase counts one unit
of training progress:

  iterations  with --train-iters: --lr-warmup-iters, --lr-decay-iters (default --train-iters)
  samples     with --train-samples: --lr-warmup-samples, --lr-decay-samples (default --train-samples). As
              Megatron's OptimizerParamScheduler, which steps by the global batch in sample mode, the LR
              follows the samples consumed: with --rampup-batch-size it is not a function of the iteration
  tokens      Megatron-DeepSpeed's --lr-warmup-tokens / --lr-decay-tokens, tokens = samples x --seq-length:
              each replaces the iteration or sample count of its own phase

The first iteration runs at the LR of position 0 (0 with a warmup). The scheduler is DeepSpeed's client
lr_scheduler: DeepSpeed calls step() after each applied optimizer step, which moves the position on by one
iteration, the global batch (train() hands it each iteration's IterationPlan: the ramp-up changes the batch,
the curriculum the sequence length) and its tokens. The decay runs from the end of the warmup to the decay's
amount; when the two phases count different units, the end of the warmup is taken in the decay's unit where a
run from the start reaches it (through the batch schedule's ramp-up).

Megatron-DeepSpeed's scheduler (megatron/optimizer_param_scheduler.py, stepped in training.py) differs:
- with --train-iters it counts samples too (the iterations x the global batch): the same LR without a
  ramp-up; with one, its LR follows samples. Here iteration mode counts iterations (--train-samples
  follows samples);
- it reads the token count before the iteration's own tokens are added (training.py adds them after
  train_step), so its token schedule runs one iteration late; here a step counts its own batch's tokens,
  as it counts its samples;
- an fp16 step skipped on overflow moves its token count but not its steps; here neither moves;
- warmup in iterations or samples with decay in tokens: it starts the decay at the token count of the step
  that lands exactly on the warmup's end (never set if a step jumps over it: the decay then fails); here at
  the tokens where the warmup ends (above). Warmup in tokens with decay in iterations or samples: it
  measures the decay from --lr-warmup-iters / -samples (0 by default, so the LR drops when the warmup
  ends); here from the end of the token warmup.

At --load, `schedule_to_resume` picks the schedule and the position training goes on from (the flags
--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler); checkpointing/manager.py calls it.
"""
import dataclasses
import math

_FLAG_SUFFIX = {"iterations": "iters", "samples": "samples", "tokens": "tokens"}


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """The values that define a schedule: what a checkpoint's schedule is compared on at --load."""
    max_lr: float
    min_lr: float
    decay_style: str
    warmup: int
    warmup_unit: str  # iterations, samples or tokens
    decay: int
    decay_unit: str

    def differences(self, saved):
        """['--lr: checkpoint 0.002, flags 0.001', ...]: each value that differs from the saved schedule's."""
        return [f"{label}: checkpoint {value(saved)}, flags {value(self)}"
                for label, value in _COMPARED if value(saved) != value(self)]


_COMPARED = (("--lr", lambda s: s.max_lr), ("--min-lr", lambda s: s.min_lr),
             ("--lr-decay-style", lambda s: s.decay_style),
             ("LR warmup (--lr-warmup-iters / -samples / -tokens / -fraction)",
              lambda s: f"{s.warmup} {s.warmup_unit}"),
             ("LR decay (--lr-decay-iters / -samples / -tokens)", lambda s: f"{s.decay} {s.decay_unit}"))


def lr_schedule_from_args(args):
    """The flags' schedule: in samples with --train-samples, else in iterations; a phase given in tokens
    (--lr-warmup-tokens, --lr-decay-tokens) counts tokens."""
    unit = "samples" if args.train_samples is not None else "iterations"
    suffix = _FLAG_SUFFIX[unit]
    warmup = (args.lr_warmup_tokens, "tokens") if args.lr_warmup_tokens is not None else \
        (getattr(args, f"lr_warmup_{suffix}"), unit)
    decay = (args.lr_decay_tokens, "tokens") if args.lr_decay_tokens is not None else \
        (getattr(args, f"lr_decay_{suffix}"), unit)
    return LRSchedule(args.lr, args.min_lr, args.lr_decay_style, *warmup, *decay)


@dataclasses.dataclass(frozen=True)
class Position:
    """How far a schedule has gone: applied optimizer steps and the samples and tokens they trained on."""
    iterations: int = 0
    samples: int = 0
    tokens: int = 0

    def advanced(self, steps, global_batch_size, seq_length):
        samples = steps * global_batch_size
        return Position(self.iterations + steps, self.samples + samples, self.tokens + samples * seq_length)

    def count(self, unit):
        return getattr(self, unit)


def learning_rate(schedule, position, decay_start):
    """The LR at position; decay_start: where the warmup ends, in the decay's unit."""
    warmed = position.count(schedule.warmup_unit)
    if schedule.warmup > 0 and warmed <= schedule.warmup:
        return schedule.max_lr * (warmed / schedule.warmup)  # the ratio first: a unit's respelling gives the same LR
    if schedule.decay_style == "constant":
        return schedule.max_lr
    decayed = position.count(schedule.decay_unit)
    if decayed > schedule.decay:
        return schedule.min_lr
    ratio = max(0, decayed - decay_start) / max(1, schedule.decay - decay_start)
    coefficient = 1.0 - ratio if schedule.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return schedule.min_lr + coefficient * (schedule.max_lr - schedule.min_lr)


def warmup_end(schedule, batch_schedule, seq_length):
    """The position of the first step at which a run from the start has finished its warmup: step by step
    through the ramp-up, then in one jump at the constant global batch."""
    position, unit = Position(), schedule.warmup_unit
    while position.count(unit) < schedule.warmup:
        batch = batch_schedule.global_batch_size(position.samples)
        if batch == batch_schedule.global_batch_size_at_end:  # constant from here on
            per_step = Position().advanced(1, batch, seq_length).count(unit)
            steps = -(-(schedule.warmup - position.count(unit)) // per_step)  # rounded up
            return position.advanced(steps, batch, seq_length)
        position = position.advanced(1, batch, seq_length)
    return position


class OptimizerParamScheduler:
    """Sets the optimizer's LR from an LRSchedule at the position training has reached."""

    def __init__(self, optimizer, schedule, seq_length, batch_schedule):
        self.optimizer, self.seq_length, self.batch_schedule = optimizer, seq_length, batch_schedule
        self.global_batch_size = batch_schedule.global_batch_size(0)  # of the steps to come (begin_iteration)
        self.resume(schedule, Position())

    def begin_iteration(self, plan):
        """The iteration to come (an IterationPlan): its step counts the plan's global batch and tokens."""
        self.global_batch_size, self.seq_length = plan.global_batch_size, plan.seq_length

    def resume(self, schedule, position):
        """Follow schedule from position on (the start, or where a checkpoint left off)."""
        if not 0.0 <= schedule.min_lr <= schedule.max_lr:
            raise ValueError(f"--min-lr {schedule.min_lr} must be between 0 and --lr {schedule.max_lr}")
        self.schedule, self.position = schedule, position
        self.decay_start = schedule.warmup if schedule.warmup_unit == schedule.decay_unit else \
            warmup_end(schedule, self.batch_schedule, self.seq_length).count(schedule.decay_unit)
        self._set_lr()

    def step(self):
        """DeepSpeed's call after each applied optimizer step (none after an fp16 step skipped on overflow)."""
        self.position = self.position.advanced(1, self.global_batch_size, self.seq_length)
        self._set_lr()

    def get_lr(self):
        return learning_rate(self.schedule, self.position, self.decay_start)

    def _set_lr(self):
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self):
        """The schedule's values and its position (JSON: saved in the checkpoint's metadata too)."""
        return {"schedule": dataclasses.asdict(self.schedule), "position": dataclasses.asdict(self.position)}

    def load_state_dict(self, state):
        """DeepSpeed's interface; megatron_ds's --load resumes through schedule_to_resume instead."""
        self.resume(LRSchedule(**state["schedule"]), Position(**state["position"]))


def schedule_to_resume(flags_schedule, saved_state, resumed_position, override=False, use_checkpoint=False):
    """(schedule, position, description) to go on with after a --load that restores the LR schedule.

    The position is the checkpoint's (as in Megatron-DeepSpeed, it also goes on under --reset-iteration).
    The values: the flags' with --override-opt_param-scheduler; the checkpoint's with
    --use-checkpoint-opt_param-scheduler; by default the two must agree, else a ValueError names each value
    that differs (Megatron asserts the same, one value at a time). A checkpoint without a schedule state
    (converted or imported) resumes the flags' schedule at resumed_position, except with
    --use-checkpoint-opt_param-scheduler: an error. States saved before the samples and tokens units
    ({num_steps, max_lr, min_lr, warmup_steps, decay_steps, decay_style}) counted iterations."""
    if saved_state is None:
        if use_checkpoint:
            raise ValueError("--use-checkpoint-opt_param-scheduler: the checkpoint holds no LR schedule (converted "
                             "or imported); drop the flag to follow the flags' schedule")
        return flags_schedule, resumed_position, "the flags' (the checkpoint holds none)"
    saved, position = _saved_schedule(saved_state, resumed_position)
    if override:
        return flags_schedule, position, "the flags' (--override-opt_param-scheduler)"
    if use_checkpoint:
        return saved, position, "the checkpoint's (--use-checkpoint-opt_param-scheduler)"
    differences = flags_schedule.differences(saved)
    if differences:
        raise ValueError("its LR schedule differs from the flags':\n  - " + "\n  - ".join(differences) + "\n"
                         "resume with --use-checkpoint-opt_param-scheduler (the checkpoint's values), "
                         "--override-opt_param-scheduler (the flags' values, at the checkpoint's position) or "
                         "--no-load-lr-state (the flags' schedule, at the resumed iteration)")
    return saved, position, "the checkpoint's (the flags agree)"


def _saved_schedule(state, resumed_position):
    try:
        if "schedule" in state:
            return LRSchedule(**state["schedule"]), Position(**state["position"])
        saved = LRSchedule(state["max_lr"], state["min_lr"], state["decay_style"], state["warmup_steps"],
                           "iterations", state["decay_steps"], "iterations")
        return saved, dataclasses.replace(resumed_position, iterations=state["num_steps"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"its LR schedule state {state} is not one megatron_ds writes ({error!r}); resume with "
                         f"--no-load-lr-state (the flags' schedule, at the resumed iteration)") from None
