"""Checkpoints of the dropless MoE layer through pretrain.py: each expert saved by its global index, the router and
the expert bias with the model. Saved at iteration 5 of a PP 2 x DP 2 run with EP 2 (the experts' optimizer states
in ZeRO-1's expert-data-parallel partitions; --async-save): resumed in place, iterations 6-10 and the iteration-10
checkpoint equal the straight run's bit for bit (the expert bias included); resumed at EP 4 x PP 1 and at TP 2
(Megatron SP) with the experts whole on each TP rank (expert TP 1) or split over TP (expert TP 2), resharded on
load, the losses within 1e-5 of the in-place resume's. Saved at TP 2 with the experts split over TP: each expert
written whole, the in-place resume bit for bit, resumed at expert TP 1 and at TP 1 within 1e-5, and converted by the
tool to whole experts that resume at expert TP 2 or 1 as its printed flags say."""
import glob
import os

import pytest
import torch

from megatron_ds.conversion.convert_cli import main as convert
from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS

DROPLESS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff",
            "0.01", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--moe-grouped-gemm",
            "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
SAVED_AT = 5
PIPELINE_EP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]


def _train(flags, ranks=4):
    result = launch(ranks, COMMON + FAMILIES["llama"] + DROPLESS + flags)
    assert_succeeded(result, tail=4000)
    return result.stdout


def _checkpoint_tensors(folder):
    """{file: {name: tensor}} of a checkpoint's model files: DeepSpeed's model states (the expert bias, the router,
    the dense weights) and one file per expert."""
    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "*model_states.pt"))):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state = state.get("module", state)
        tensors[os.path.basename(path)] = {name: value for name, value in state.items()
                                           if isinstance(value, torch.Tensor)}
    return tensors


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The straight run, saving at iterations 5 and 10 (in the background: --async-save writes the expert files
    too), and the in-place resume from 5 saving at 10."""
    folder = tmp_path_factory.mktemp("dropless_checkpoints")
    straight = _train([*PIPELINE_EP2, "--save", str(folder / "straight"), "--save-interval", str(SAVED_AT),
                       "--async-save"])
    resumed = _train([*PIPELINE_EP2, "--load", str(folder / "straight"), "--load-iteration", str(SAVED_AT),
                      "--save", str(folder / "resumed"), "--save-interval", str(SAVED_AT)])
    assert f"resuming at iteration {SAVED_AT}" in resumed, resumed[-4000:]
    return folder, straight, resumed


def test_a_resume_in_place_continues_the_run_bit_for_bit(saved):
    folder, straight, resumed = saved
    expected, observed = losses(straight), losses(resumed)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), resumed[-3000:]
    assert {iteration: expected[iteration] for iteration in observed} == observed
    final = f"global_step{ITERATIONS}"
    straight_files = _checkpoint_tensors(folder / "straight" / final)
    resumed_files = _checkpoint_tensors(folder / "resumed" / final)
    experts = [name for name in straight_files if "_expert_" in name]
    assert len(experts) == 4 * 4, sorted(straight_files)  # 4 layers x 4 experts, one file each
    assert straight_files.keys() == resumed_files.keys()
    biases = 0
    for name, tensors in straight_files.items():
        for key, value in tensors.items():
            assert torch.equal(value, resumed_files[name][key]), (name, key)
            biases += key.endswith("expert_bias")
    assert biases == 4, "each of the 4 MoE layers' expert bias is saved with its stage"
    moved = [value for tensors in straight_files.values() for key, value in tensors.items()
             if key.endswith("expert_bias")]
    assert all(bias.abs().sum() > 0 for bias in moved), moved  # the bias did move: the comparison means something


@pytest.mark.parametrize("layout", [
    ["--expert-model-parallel-size", "4"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "128",
     "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "128",
     "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
], ids=["ep4_pp1", "tp2_etp1", "tp2_etp2"])
def test_a_checkpoint_resumes_at_other_expert_tensor_and_pipeline_layouts(saved, layout):
    folder, _, resumed = saved
    other = _train([*layout, "--load", str(folder / "straight"), "--load-iteration", str(SAVED_AT)])
    assert f"resuming at iteration {SAVED_AT}" in other and "resharded to" in other, other[-4000:]
    expected, observed = losses(resumed), losses(other)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), other[-3000:]
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5, abs=0), (iteration, observed, expected)


def test_the_conversion_tool_reshapes_a_checkpoint_that_resumes_with_the_same_losses(saved):
    """tools/convert_checkpoint.py: every expert by its global index through the layout-free state, to TP 2 x PP 1;
    resumed there at EP 2, iterations 6-10 within 1e-5 of the in-place resume's."""
    folder, _, resumed = saved
    assert convert(["--load", str(folder / "straight"), "--load-iteration", str(SAVED_AT), "--save",
                    str(folder / "tp2"), "--target-tensor-parallel-size", "2",
                    "--target-pipeline-model-parallel-size", "1"]) == 0
    other = _train(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by",
                    "128", "--expert-model-parallel-size", "2", "--load", str(folder / "tp2")])
    assert f"resuming at iteration {SAVED_AT}" in other, other[-4000:]
    expected, observed = losses(resumed), losses(other)
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5, abs=0), (iteration, observed, expected)


SPLIT_EXPERTS = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "128",
                 "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def saved_with_split_experts(tmp_path_factory):
    """TP 2 x DP 2 with the experts split over TP (expert TP 2, EP 2 over the DP ranks of each TP rank), saving
    at iterations 5 and 10, and its in-place resume from 5."""
    folder = tmp_path_factory.mktemp("dropless_split_experts")
    straight = _train([*SPLIT_EXPERTS, "--save", str(folder / "straight"), "--save-interval", str(SAVED_AT)])
    resumed = _train([*SPLIT_EXPERTS, "--load", str(folder / "straight"), "--load-iteration", str(SAVED_AT)])
    assert f"resuming at iteration {SAVED_AT}" in resumed, resumed[-4000:]
    return folder, straight, resumed


def test_experts_split_over_tensor_parallel_ranks_are_saved_whole_and_resume_in_place_bit_for_bit(
        saved_with_split_experts):
    folder, straight, resumed = saved_with_split_experts
    expected, observed = losses(straight), losses(resumed)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), resumed[-3000:]
    assert {iteration: expected[iteration] for iteration in observed} == observed
    experts = {name: tensors for name, tensors in _checkpoint_tensors(folder / "straight" / f"global_step{SAVED_AT}")
               .items() if "_expert_" in name}
    assert len(experts) == 4 * 4, sorted(experts)  # 4 layers x 4 experts, each whole in one file
    shapes = {key.rsplit(".", 1)[1]: tuple(value.shape)
              for tensors in experts.values() for key, value in tensors.items()}
    assert shapes == {"w1": (48, 64), "w3": (48, 64), "w2": (64, 48)}, shapes


@pytest.mark.parametrize("layout, ranks", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "128",
      "--expert-model-parallel-size", "2"], 4),
    (["--expert-model-parallel-size", "2"], 2),
], ids=["tp2_etp1", "tp1"])
def test_experts_saved_split_over_tensor_parallel_ranks_resume_whole(saved_with_split_experts, layout, ranks):
    folder, _, resumed = saved_with_split_experts
    other = _train([*layout, "--load", str(folder / "straight"), "--load-iteration", str(SAVED_AT)], ranks=ranks)
    assert f"resuming at iteration {SAVED_AT}" in other, other[-4000:]
    expected, observed = losses(resumed), losses(other)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), other[-3000:]
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5, abs=0), (iteration, observed, expected)


@pytest.mark.parametrize("expert_tensor_parallelism", ["on", "off"])
def test_the_conversion_tool_reshapes_experts_saved_split_over_tensor_parallel_ranks(
        saved_with_split_experts, expert_tensor_parallelism, capsys):
    """tools/convert_checkpoint.py on the expert-TP-2 checkpoint: the experts' F slices joined into whole experts
    (the files of a converted checkpoint hold each expert whole: any expert TP loads them); with
    --target-expert-tensor-parallelism on the printed flags train them split over TP 2 again, with off whole on
    each TP rank; either resumes within 1e-5 of the in-place resume."""
    folder, _, resumed = saved_with_split_experts
    target = folder / f"converted_etp_{expert_tensor_parallelism}"
    assert convert(["--load", str(folder / "straight"), "--load-iteration", str(SAVED_AT), "--save", str(target),
                    "--target-tensor-parallel-size", "2", "--target-pipeline-model-parallel-size", "1",
                    "--target-expert-tensor-parallelism", expert_tensor_parallelism]) == 0
    printed = capsys.readouterr().out
    expert_tp = "2" if expert_tensor_parallelism == "on" else "1"
    assert f"--expert-tensor-parallel-size {expert_tp}" in printed, printed
    layout = [*SPLIT_EXPERTS[:-1], expert_tp]
    other = _train([*layout, "--load", str(target)])
    assert f"resuming at iteration {SAVED_AT}" in other, other[-4000:]
    expected, observed = losses(resumed), losses(other)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), other[-3000:]
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5, abs=0), (iteration, observed, expected)
