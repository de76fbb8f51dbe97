"""pretrain.py with the schedule flags: --train-samples respells --train-iters (same losses and LRs) and,
with a batch ramp-up, makes the LR follow samples; --train-tokens stops training and token schedules count
tokens; the checkpoint scheduler flags decide the schedule at --load. Tiny single-rank runs; the flag tests
resume the checkpoint the --train-tokens run saves. The schedule's arithmetic: test_optimizer_param_scheduler.py."""
import re

import pytest

from megatron_ds.checkpointing import files
from tests.support.checkpoints import TINY
from tests.support.launch import assert_succeeded, launch

ITERATION_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples: (\d+) \|.*? learning rate: (\S+) \|"
                            r".*? lm loss: (\S+) \|")
LR = 2e-3  # TINY's --lr; batch 4 x --seq-length 16 = 64 tokens an iteration


def _run(flags):
    result = launch(1, TINY + flags)
    assert_succeeded(result, tail=5000)
    return result.stdout


def _printed(output):
    """{iteration: (consumed samples, learning rate, lm loss)} as printed."""
    return {int(i): (int(samples), lr, loss) for i, samples, lr, loss in ITERATION_LINE.findall(output)}


def _lrs(output):
    return [float(lr) for _, (_, lr, _) in sorted(_printed(output).items())]


def _assert_lrs(output, expected):
    assert _lrs(output) == pytest.approx(expected, rel=1e-6, abs=1e-12), output[-3000:]


def test_train_samples_respells_train_iters():
    """6 iterations of 4 samples: warmup 2 iterations = 8 samples, cosine decay to 5 iterations = 20 samples."""
    common = ["--lr-decay-style", "cosine", "--min-lr", "1e-4"]
    in_iterations = _run(common + ["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "5"])
    in_samples = _run(common + ["--train-samples", "24", "--lr-warmup-samples", "8", "--lr-decay-samples", "20"])
    assert sorted(_printed(in_iterations)) == list(range(1, 7)), in_iterations[-3000:]
    assert _printed(in_samples) == _printed(in_iterations)


def test_with_a_rampup_the_lr_follows_samples():
    """Batches 4, 4, 8, 12, then 16 (ramp 4 4 24); 92 samples are 8 iterations. Warmup 16 samples, linear decay
    to 0 at 92: the LR of an iteration is set by the samples consumed before it, 0 4 8 16 28 44 60 76; counted
    in iterations (warmup 16 samples = 1 iteration at the full batch, decay over the 8) it would be otherwise."""
    output = _run(["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24", "--train-samples", "92",
                   "--lr-warmup-samples", "16"])
    assert [samples for _, (samples, _, _) in sorted(_printed(output).items())] == [4, 8, 16, 28, 44, 60, 76, 92]
    before = [0, 4, 8, 16, 28, 44, 60, 76]
    by_samples = [LR * s / 16 if s <= 16 else LR * (1 - (s - 16) / (92 - 16)) for s in before]
    by_iterations = [0.0] + [LR * (1 - (i - 1) / (8 - 1)) for i in range(1, 8)]
    _assert_lrs(output, by_samples)
    for iteration in (2, 3, 5, 7):
        assert by_samples[iteration - 1] != pytest.approx(by_iterations[iteration - 1], rel=1e-3)


TOKENS = ["--lr-warmup-tokens", "128", "--lr-decay-tokens", "640"]  # 2 iterations; decay to 0 at 10


@pytest.fixture(scope="module")
def tokens_run(tmp_path_factory):
    """--train-tokens 300 with --train-iters 10: 4 iterations hold 256 tokens, so the 5th runs and then 320
    tokens are consumed; saved at the end. (checkpoint folder, output)"""
    save = tmp_path_factory.mktemp("train_tokens") / "ckpt"
    return save, _run(TOKENS + ["--train-iters", "10", "--train-tokens", "300", "--save", str(save)])


def test_train_tokens_stops_and_saves_and_token_schedules_count_tokens(tokens_run):
    save, output = tokens_run
    assert sorted(_printed(output)) == [1, 2, 3, 4, 5], output[-3000:]
    assert "--train-tokens 300 reached: 320 tokens consumed at iteration 5" in output
    _assert_lrs(output, [0.0, LR / 2, LR, LR * (1 - 64 / 512), LR * (1 - 128 / 512)])
    assert files.read_pointer(str(save)) == "global_step5"
    metadata = files.read_metadata(str(save / "global_step5"))
    assert (metadata["iteration"], metadata["consumed_train_tokens"]) == (5, 320)
    assert metadata["scheduler"]["position"] == {"iterations": 5, "samples": 20, "tokens": 320}


def _resume(tokens_run, flags):
    save, _ = tokens_run
    return _run(TOKENS + ["--load", str(save)] + flags)


def test_override_takes_the_flags_values_from_the_checkpoints_position(tokens_run):
    output = _resume(tokens_run, ["--train-iters", "7", "--lr", "4e-3", "--override-opt_param-scheduler"])
    assert "LR schedule the flags' (--override-opt_param-scheduler)" in output, output[-3000:]
    _assert_lrs(output, [4e-3 * (1 - 192 / 512), 4e-3 * (1 - 256 / 512)])  # iterations 6, 7 at 320, 384 tokens


def test_use_checkpoint_with_reset_iteration_goes_on_with_the_checkpoints_schedule_from_iteration_1(tokens_run):
    """The checkpoint's values (--lr 2e-3, decay 640 tokens) at its position (320 tokens), while the
    iteration and consumed samples restart and the optimizer states load."""
    output = _resume(tokens_run, ["--train-iters", "7", "--lr", "4e-3", "--lr-decay-tokens", "1280",
                                  "--use-checkpoint-opt_param-scheduler", "--reset-iteration"])
    assert "resuming at iteration 0, consumed samples 0, optimizer states loaded" in output, output[-3000:]
    assert "(--reset-iteration: iteration 0)" in output
    assert [samples for _, (samples, _, _) in sorted(_printed(output).items())] == [4, 8, 12, 16, 20, 24, 28]
    _assert_lrs(output, [LR * max(0.0, 1 - (tokens - 128) / 512) for tokens in range(320, 768, 64)])


def test_no_load_lr_state_with_reset_iteration_restarts_the_flags_schedule(tokens_run):
    """Megatron-DeepSpeed's compression recipe: the trained weights, a fresh warmup from iteration 1."""
    _, fresh = tokens_run
    output = _resume(tokens_run, ["--train-iters", "3", "--no-load-lr-state", "--reset-iteration"])
    assert "LR schedule the flags' from iteration 0 (--no-load-lr-state)" in output, output[-3000:]
    _assert_lrs(output, [0.0, LR / 2, LR])
    assert _printed(output)[1][2] != _printed(fresh)[1][2]  # the same first batch, on the loaded weights
