"""The load plan's choice of the LR schedule and the progress at --load (in process, on metadata): the
checkpoint scheduler flags, --no-load-lr-state, --reset-iteration and --finetune."""
import dataclasses

import pytest

from megatron_ds.arguments import parse_args
from megatron_ds.checkpointing import TrainingProgress, files, load_plan
from megatron_ds.core.optimizer_param_scheduler import LRSchedule, Position
from tests.support.checkpoints import TINY, layout_flags

SAVED = LRSchedule(2e-3, 0.0, "linear", 2, "iterations", 8, "iterations")
METADATA = {"iteration": 5, "consumed_train_samples": 20, "consumed_valid_samples": 4,
            "consumed_train_tokens": 320,
            "scheduler": {"schedule": dataclasses.asdict(SAVED),
                          "position": {"iterations": 5, "samples": 20, "tokens": 320}}}


def _args(*flags):
    return parse_args(TINY + ["--train-iters", "8", "--lr-warmup-iters", "2", "--load", "ckpt", *flags]
                      + layout_flags(1, 1), world_size=1)


def _resume(*flags, metadata=METADATA, finetune=False):
    request = load_plan.LoadRequest.of_run(_args(*flags))
    progress = load_plan.resumed_progress(request, metadata, finetune)
    return progress, load_plan.lr_schedule_to_resume(request, "ckpt/global_step5", metadata, progress, finetune)


def test_default_resumes_the_checkpoints_schedule_and_progress():
    progress, (schedule, position, _) = _resume()
    assert progress == TrainingProgress(5, 20, 4, 320)
    assert (schedule, position) == (SAVED, Position(5, 20, 320))


def test_default_refuses_other_schedule_values_naming_them():
    with pytest.raises(files.CheckpointError) as error:
        _resume("--lr", "1e-3", "--lr-decay-style", "cosine")
    message = str(error.value)
    assert message.startswith("checkpoint ckpt/global_step5: its LR schedule differs from the flags'")
    assert "--lr: checkpoint 0.002, flags 0.001" in message and "--lr-decay-style: checkpoint linear, flags cosine" \
        in message


def test_no_load_lr_state_takes_the_flags_schedule_at_the_resumed_progress():
    progress, (schedule, position, how) = _resume("--lr", "1e-3", "--no-load-lr-state")
    assert progress.iteration == 5 and position == Position(5, 20, 320)
    assert schedule.max_lr == 1e-3 and how == "the flags' from iteration 5 (--no-load-lr-state)"


def test_reset_iteration_starts_the_progress_at_0_and_the_schedule_goes_on():
    progress, (schedule, position, _) = _resume("--reset-iteration")
    assert progress == TrainingProgress()
    assert (schedule, position) == (SAVED, Position(5, 20, 320))
    _, (_, position, _) = _resume("--reset-iteration", "--no-load-lr-state")
    assert position == Position()


def test_finetune_takes_the_flags_schedule_from_0():
    progress, (_, position, how) = _resume("--lr", "1e-3", finetune=True)
    assert progress == TrainingProgress() and position == Position() and "(--finetune)" in how


def test_tokens_of_a_checkpoint_that_did_not_count_them_are_its_samples_times_seq_length():
    older = {key: value for key, value in METADATA.items() if key != "consumed_train_tokens"}
    progress, _ = _resume(metadata=older)
    assert progress.consumed_train_tokens == 20 * 16
