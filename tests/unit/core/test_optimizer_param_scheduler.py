"""The LR schedule in iterations, samples and tokens (numbers worked out by hand), and what --load resumes."""
import dataclasses
import math

import pytest
import torch

from megatron_ds.arguments import parse_args
from megatron_ds.core.batch_schedule import ConstantBatchSize, RampupBatchSize
from megatron_ds.core.optimizer_param_scheduler import (
    LRSchedule,
    OptimizerParamScheduler,
    Position,
    lr_schedule_from_args,
    schedule_to_resume,
    warmup_end,
)

SEQ = 16


def _scheduler(style="linear", warmup=4, decay=14, max_lr=1.0, min_lr=0.1, warmup_unit="iterations",
               decay_unit=None, batches=None):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=max_lr)
    schedule = LRSchedule(max_lr, min_lr, style, warmup, warmup_unit, decay, decay_unit or warmup_unit)
    return optimizer, OptimizerParamScheduler(optimizer, schedule, SEQ, batches or ConstantBatchSize(4))


def _trajectory(scheduler, steps=16, batches=None):
    """The LR of each iteration; batches: a batch schedule for the loop's global batch (as train() sets it)."""
    lrs, consumed = [], 0
    for _ in range(steps):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        if batches is not None:
            scheduler.global_batch_size = batches.global_batch_size(consumed)
            consumed += scheduler.global_batch_size
        scheduler.step()
    return lrs


def _iterations(style, steps=16):
    return _trajectory(_scheduler(style)[1], steps)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_linear_warmup_from_zero(style):
    assert _iterations(style)[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_linear_decay_reaches_min_lr_at_decay_iters():
    lrs = _iterations("linear")
    assert lrs[9] == pytest.approx(0.1 + 0.9 * (1 - 5 / 10))
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)


def test_cosine_decay():
    lrs = _iterations("cosine")
    assert lrs[7] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 3 / 10) + 1))
    assert lrs[14] == pytest.approx(0.1)


def test_constant_after_warmup():
    assert _iterations("constant")[4:] == pytest.approx([1.0] * 12)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_samples_respelling_the_iterations_give_identical_lrs(style):
    """Warmup 2 and decay 6 iterations of a constant batch of 4 = 8 and 24 samples: bit-identical LRs."""
    in_iterations = _trajectory(_scheduler(style, warmup=2, decay=6)[1], 8)
    in_samples = _trajectory(_scheduler(style, warmup=8, decay=24, warmup_unit="samples")[1], 8)
    assert in_samples == in_iterations


def test_samples_follow_the_rampup():
    """Batches 4, 4, 8, 12, 16, ... (ramp 4 4 24 to 16): before iterations 1..7 the samples consumed are
    0, 4, 8, 16, 28, 44, 60. Warmup 16 samples, linear decay to 0 at 92."""
    ramp = RampupBatchSize(4, 4, 24, 16, 2, 1)
    _, scheduler = _scheduler(warmup=16, decay=92, min_lr=0.0, warmup_unit="samples", batches=ramp)
    expected = [0.0, 4 / 16, 8 / 16, 1.0, 1 - 12 / 76, 1 - 28 / 76, 1 - 44 / 76]
    assert _trajectory(scheduler, 7, ramp) == pytest.approx(expected)


def test_tokens_warmup_and_decay():
    """64 tokens a step (batch 4 x 16); warmup 128 tokens, linear decay to 0 at 640."""
    _, scheduler = _scheduler(warmup=128, decay=640, min_lr=0.0, warmup_unit="tokens")
    expected = [0.0, 0.5, 1.0, 1 - 64 / 512, 1 - 128 / 512, 1 - 192 / 512]
    assert _trajectory(scheduler, 6) == pytest.approx(expected)
    assert _trajectory(scheduler, 12)[-1] == 0.0


def test_iteration_warmup_with_token_decay_decays_from_the_warmup_end():
    """Megatron-DeepSpeed's mix (--lr-warmup-iters, --lr-decay-tokens): warmup 2 iterations end at 128 tokens."""
    _, scheduler = _scheduler(warmup=2, decay=640, min_lr=0.0, decay_unit="tokens")
    assert scheduler.decay_start == 128
    assert _trajectory(scheduler, 5) == pytest.approx([0.0, 0.5, 1.0, 1 - 64 / 512, 1 - 128 / 512])


def test_token_warmup_with_iteration_decay_decays_from_the_warmup_end():
    """Warmup 100 tokens = 2 steps of 64 (the second passes it): decay over iterations 2..10."""
    _, scheduler = _scheduler(warmup=100, decay=10, min_lr=0.0, warmup_unit="tokens", decay_unit="iterations")
    assert scheduler.decay_start == 2
    assert _trajectory(scheduler, 4) == pytest.approx([0.0, 0.64, 1.0, 1 - 1 / 8])


def test_warmup_end_walks_the_rampup_then_jumps():
    """Batches 4, 4, 8, 12 reach 28 samples in 4 iterations; 72 more at 16 take 5: iteration 9, 108 samples."""
    ramp = RampupBatchSize(4, 4, 24, 16, 2, 1)
    schedule = LRSchedule(1.0, 0.0, "linear", 100, "samples", 10_000, "tokens")
    assert warmup_end(schedule, ramp, SEQ) == Position(9, 108, 108 * SEQ)
    in_iterations = dataclasses.replace(schedule, warmup=3, warmup_unit="iterations")
    assert warmup_end(in_iterations, ramp, SEQ) == Position(3, 16, 16 * SEQ)


def test_state_round_trip():
    _, scheduler = _scheduler("cosine", warmup=128, decay=640, warmup_unit="tokens")
    for _ in range(6):
        scheduler.step()
    optimizer, restored = _scheduler("cosine")
    restored.load_state_dict(scheduler.state_dict())
    assert restored.position == Position(6, 24, 384) and restored.schedule == scheduler.schedule
    assert optimizer.param_groups[0]["lr"] == scheduler.get_lr()


# --- the flags' schedule ------------------------------------------------------------------------------

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
         "--global-batch-size 4 --mock-data --vocab-size 128").split()


def _flags_schedule(flags):
    return lr_schedule_from_args(parse_args(MODEL + flags.split(), world_size=1))


@pytest.mark.parametrize("flags,expected", [
    ("--train-iters 10 --lr-warmup-iters 2", (2, "iterations", 10, "iterations")),
    ("--train-samples 40 --lr-warmup-samples 8", (8, "samples", 40, "samples")),
    ("--train-samples 40 --lr-warmup-fraction 0.25 --lr-decay-samples 32", (8, "samples", 32, "samples")),
    ("--train-samples 40 --lr-warmup-tokens 128 --lr-decay-tokens 640", (128, "tokens", 640, "tokens")),
    ("--train-iters 10 --lr-warmup-iters 2 --lr-decay-tokens 640", (2, "iterations", 640, "tokens")),
])
def test_flags_schedule_units(flags, expected):
    schedule = _flags_schedule(flags)
    assert (schedule.warmup, schedule.warmup_unit, schedule.decay, schedule.decay_unit) == expected


def test_warmup_fraction_and_tokens_are_refused_together():
    from megatron_ds.arguments import ArgumentsError
    with pytest.raises(ArgumentsError, match="--lr-warmup-fraction .* and --lr-warmup-tokens"):
        parse_args(MODEL + "--train-iters 10 --lr-warmup-fraction 0.1 --lr-warmup-tokens 64".split(), world_size=1)


# --- resuming at --load -------------------------------------------------------------------------------

SAVED = LRSchedule(2e-3, 0.0, "linear", 128, "tokens", 640, "tokens")
SAVED_STATE = {"schedule": dataclasses.asdict(SAVED), "position": {"iterations": 5, "samples": 20, "tokens": 320}}
RESUMED = Position(5, 20, 320)


def test_default_resume_needs_the_flags_to_agree():
    schedule, position, _ = schedule_to_resume(SAVED, SAVED_STATE, Position())
    assert (schedule, position) == (SAVED, RESUMED)
    flags = LRSchedule(4e-3, 0.0, "cosine", 8, "samples", 640, "tokens")
    with pytest.raises(ValueError) as error:
        schedule_to_resume(flags, SAVED_STATE, RESUMED)
    message = str(error.value)
    for expected in ("--lr: checkpoint 0.002, flags 0.004", "--lr-decay-style: checkpoint linear, flags cosine",
                     "checkpoint 128 tokens, flags 8 samples", "--use-checkpoint-opt_param-scheduler",
                     "--override-opt_param-scheduler", "--no-load-lr-state"):
        assert expected in message, message
    assert "LR decay" not in message and "--min-lr" not in message


def test_override_takes_the_flags_values_at_the_checkpoints_position():
    flags = LRSchedule(4e-3, 0.0, "linear", 128, "tokens", 1280, "tokens")
    assert schedule_to_resume(flags, SAVED_STATE, Position(), override=True)[:2] == (flags, RESUMED)


def test_use_checkpoint_takes_the_checkpoints_values():
    flags = LRSchedule(4e-3, 0.0, "linear", 128, "tokens", 1280, "tokens")
    assert schedule_to_resume(flags, SAVED_STATE, Position(), use_checkpoint=True)[:2] == (SAVED, RESUMED)


def test_a_checkpoint_without_a_schedule_resumes_the_flags_unless_use_checkpoint():
    assert schedule_to_resume(SAVED, None, RESUMED)[:2] == (SAVED, RESUMED)
    with pytest.raises(ValueError, match="holds no LR schedule"):
        schedule_to_resume(SAVED, None, RESUMED, use_checkpoint=True)


def test_a_state_saved_before_units_counted_iterations():
    old = {"num_steps": 6, "max_lr": 2e-3, "min_lr": 0.0, "warmup_steps": 2, "decay_steps": 10,
           "decay_style": "cosine"}
    flags = LRSchedule(2e-3, 0.0, "cosine", 2, "iterations", 10, "iterations")
    assert schedule_to_resume(flags, old, Position(6, 24, 384))[:2] == (flags, Position(6, 24, 384))
    with pytest.raises(ValueError, match="is not one megatron_ds writes .*--no-load-lr-state"):
        schedule_to_resume(flags, {"num_steps": 6}, RESUMED)
