"""Resharding on load: a checkpoint saved at one TP x PP x DP x ZeRO layout continues at another with pretrain.py
--load alone. GPT-2 family, fp32, dropout 0: 5 iterations at TP 2 x PP 2, saved, resumed at TP 1 x PP 2 x DP 2,
TP 1 x PP 1 x DP 4, TP 2 x PP 1 x DP 2 and TP 4 x PP 1: iterations 6-10 within 1e-4 of the straight run; with
--no-load-optim they are not (the Adam moments were carried). Saved at ZeRO-1 DP 2, resumed at ZeRO-0 DP 1 and
ZeRO-2 DP 2. Through DeepSpeed's ds_to_universal and back (--universal-checkpoint): the same figures; a damaged
universal folder is refused by file name."""
import os
import shutil
import subprocess
import sys

import pytest

from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import deepspeed_universal as universal
from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, ITERATIONS, run_layout

SAVED_AT = 5


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--make-vocab-size-divisible-by", str(256 // tp)]


def _save_first_iterations(folder, nproc, flags):
    result = launch(nproc, COMMON + flags + ["--save", str(folder), "--exit-interval", str(SAVED_AT)])
    assert_succeeded(result, tail=4000)


def _resume(folder, nproc, flags):
    result = launch(nproc, COMMON + flags + ["--load", str(folder)])
    assert_succeeded(result, tail=4000)
    assert f"resuming at iteration {SAVED_AT}" in result.stdout, result.stdout[-4000:]
    observed = losses(result.stdout)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), result.stdout[-4000:]
    return observed, result.stdout


def _matches(observed, expected):
    return all(observed[i] == pytest.approx(expected[i], rel=1e-4) for i in observed)


@pytest.fixture(scope="module")
def saved_at_tp2_pp2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp2_pp2")
    _save_first_iterations(folder, 4, _layout(2, 2))
    return folder


@pytest.mark.parametrize("tp, pp, dp", [(1, 2, 2), (1, 1, 4), (4, 1, 1)], ids=["tp1-pp2-dp2", "tp1-pp1-dp4", "tp4-pp1"])
def test_tp2_pp2_checkpoint_continues_at_another_layout(saved_at_tp2_pp2, tp, pp, dp):
    straight = run_layout("gpt2", 2, 2, 1)
    observed, output = _resume(saved_at_tp2_pp2, tp * pp * dp, _layout(tp, pp))
    assert f"saved at TP 2 x PP 2 x DP 1) via deepspeed files read per rank (weights and optimizer states, " \
           f"resharded to TP {tp} x PP {pp})" in output, output[-3000:]
    assert _matches(observed, straight), (observed, straight)


def test_without_the_optimizer_states_the_losses_differ(saved_at_tp2_pp2):
    straight = run_layout("gpt2", 2, 2, 1)
    observed, output = _resume(saved_at_tp2_pp2, 4, _layout(1, 1) + ["--no-load-optim"])
    assert "optimizer states not loaded" in output, output[-3000:]
    assert not _matches(observed, straight), (observed, straight)


@pytest.mark.parametrize("zero_stage, dp", [(0, 1), (2, 2)], ids=["zero0-dp1", "zero2-dp2"])
def test_zero1_dp2_checkpoint_continues_at_another_zero_stage(tmp_path_factory, zero_stage, dp):
    folder = tmp_path_factory.getbasetemp() / "zero1_dp2"
    if not folder.exists():
        _save_first_iterations(folder, 2, _layout(1, 1))
    straight = run_layout("gpt2", 1, 1, 2)
    observed, _ = _resume(folder, dp, _layout(1, 1) + ["--zero-stage", str(zero_stage)])
    assert _matches(observed, straight), (observed, straight)


def _to_universal(checkpoint_folder, output_root):
    """DeepSpeed's converter, run as a user runs it: OUTPUT_ROOT/global_step5_universal and its pointer."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
               "--input_folder", str(checkpoint_folder / f"global_step{SAVED_AT}"),
               "--output_folder", str(output_root / f"global_step{SAVED_AT}_universal"),
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=4000)
    return output_root


@pytest.fixture(scope="module")
def universal_from_tp2_pp2(saved_at_tp2_pp2, tmp_path_factory):
    return _to_universal(saved_at_tp2_pp2, tmp_path_factory.mktemp("universal"))


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 2), (1, 2, 2)], ids=["tp1-pp1-dp2", "tp1-pp2-dp2"])
def test_deepspeed_universal_checkpoint_continues_at_another_layout(universal_from_tp2_pp2, tp, pp, dp):
    """Saved at TP 2 x PP 2, converted by ds_to_universal, loaded by DeepSpeed's universal loading into a plain
    engine (parameters named otherwise than the pipeline's) and into another pipeline."""
    straight = run_layout("gpt2", 2, 2, 1)
    observed, output = _resume(universal_from_tp2_pp2, tp * pp * dp, _layout(tp, pp) + ["--universal-checkpoint"])
    assert "(deepspeed universal format, saved at TP 2 x PP 2 x DP 1) via DeepSpeed's universal checkpoint " \
           "loading" in output, output[-3000:]
    assert _matches(observed, straight), (observed, straight)


def _copy_universal(source, destination):
    shutil.copytree(source, destination)
    return destination / f"global_step{SAVED_AT}_universal"


def test_a_damaged_universal_checkpoint_is_refused_by_file_name(universal_from_tp2_pp2, tmp_path):
    folder = _copy_universal(universal_from_tp2_pp2, tmp_path / "damaged")
    (folder / "zero" / "1.mlp.linear_fc1.weight" / "exp_avg.pt").unlink()
    truncated = folder / "zero" / "2.self_attention.linear_qkv.weight" / "fp32.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    result = launch(2, COMMON + _layout(1, 1) + ["--load", str(tmp_path / "damaged"), "--universal-checkpoint"])
    assert result.returncode != 0
    for problem in ("zero/1.mlp.linear_fc1.weight/exp_avg.pt is missing",
                    "zero/2.self_attention.linear_qkv.weight/fp32.pt is truncated or damaged"):
        assert problem in result.stdout, result.stdout[-3000:]
    assert "iteration        6" not in result.stdout


def test_a_partial_universal_conversion_is_refused(universal_from_tp2_pp2, tmp_path):
    """ds_to_universal killed mid-way leaves its tmp/ folder (and no zero/optimizer_state.pt yet)."""
    folder = _copy_universal(universal_from_tp2_pp2, tmp_path / "partial")
    (folder / "tmp").mkdir()
    (folder / "zero" / "optimizer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="tmp/ folder is still there .*; zero/optimizer_state.pt is missing"):
        universal.resolve(str(tmp_path / "partial"))
