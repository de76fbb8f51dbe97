"""Megatron's --check-for-nan-in-loss-and-grad (on by default in fp32 and bf16): a run whose loss or gradient
norm turns NaN/Inf stops at that iteration on every rank with the iteration, the rank and the values, exit 1,
and never saves it; --no-check-for-nan-in-loss-and-grad trains on as before, until more than
--max-consecutive-skipped-steps optimizer steps in a row are skipped."""
import re

import torch

from megatron_ds.checkpointing import files
from tests.support.checkpoints import TINY, full_state
from tests.support.launch import launch

DIVERGING = TINY + ["--lr", "1e4", "--eval-interval", "0"]  # fp32: the loss is NaN from iteration 4


def test_a_diverging_run_stops_before_saving_a_non_finite_iteration(tmp_path):
    result = launch(2, DIVERGING + ["--train-iters", "10", "--save-interval", "1", "--save", str(tmp_path)])
    assert result.returncode == 1, result.stdout[-3000:]
    stops = re.findall(r"megatron_ds: error: iteration (\d+): (.*?) on rank (\d)", result.stdout)
    assert sorted(rank for _, _, rank in stops) == ["0", "1"], result.stdout[-3000:]
    assert len({iteration for iteration, _, _ in stops}) == 1 and re.search(r"\b(nan|inf)\b", stops[0][1]), stops
    stopped_at = int(stops[0][0])
    assert files.read_pointer(str(tmp_path)) == files.tag_for(stopped_at - 1)
    assert not (tmp_path / files.tag_for(stopped_at)).exists()
    saved = full_state(tmp_path / files.tag_for(stopped_at - 1))
    assert all(torch.isfinite(tensor).all() for tensor in saved.weights.values())


def test_the_check_can_be_turned_off_and_then_the_skipped_steps_limit_stops_the_run(tmp_path):
    """Without the check the run trains on past a NaN loss; DeepSpeed's ZeRO skips every step from then on (its
    overflow check, as fp16's loss scaling does), and more than --max-consecutive-skipped-steps of them in a row
    stop the run on every rank, unsaved."""
    result = launch(2, DIVERGING + ["--train-iters", "10", "--no-check-for-nan-in-loss-and-grad",
                                    "--max-consecutive-skipped-steps", "2", "--save-interval", "1",
                                    "--save", str(tmp_path)])
    assert result.returncode == 1, result.stdout[-3000:]
    nan_iterations = [int(i) for i in re.findall(r" iteration\s+(\d+)/\s*10 \|.*lm loss: nan", result.stdout,
                                                  re.IGNORECASE)]
    assert len(nan_iterations) == 3, result.stdout[-3000:]
    stops = re.findall(r"megatron_ds: error: iteration (\d+): DeepSpeed skipped the optimizer step 3 times in a row "
                       r"\(gradient overflow; loss scale 1\), more than --max-consecutive-skipped-steps 2",
                       result.stdout)
    assert stops == [str(nan_iterations[-1])] * 2, result.stdout[-3000:]
    assert files.read_pointer(str(tmp_path)) == files.tag_for(nan_iterations[-1] - 1)
