"""Mixture of Experts through pretrain.py on 4 real ranks: top-2 routing without token dropping or second-expert
sampling is the same computation at every expert-parallel size and pipeline split, so EP 1, 2 and 4 at DP 4,
EP 1 and 2 at PP 2 x DP 2 (MoE layers inside DeepSpeed's pipeline stages) and EP 1, 2 and 4 at TP 2 x DP 2 give
the same lm and moe losses;
bf16 (DeepSpeed's BF16_Optimizer with its expert parameter groups) tracks fp32; a run saved at PP 2 x DP 2 x EP 2
resumes bitwise, and at EP 1 or reshaped to TP 2 it trains on with the same losses."""
import re

import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, ITERATIONS

MOE = ["--num-experts", "4", "--topk", "2", "--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling",
       "--moe-min-capacity", "0"]
MOE_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: \S+ \| moe loss: (\S+) \|")
_runs = {}


def _run(ep, *flags):
    key = (ep, flags)
    if key not in _runs:
        result = launch(4, COMMON + MOE + ["--moe-expert-parallel-size", str(ep), *flags])
        assert_succeeded(result, tail=4000)
        _runs[key] = result.stdout
    return _runs[key]


def _losses(output, iterations=range(1, ITERATIONS + 1)):
    lm, moe = losses(output), {int(i): float(loss) for i, loss in MOE_LOSS.findall(output)}
    assert sorted(lm) == sorted(moe) == list(iterations), output[-3000:]
    return lm, moe


@pytest.mark.parametrize("ep", [2])  # EP 4: across TP ranks in the next test
def test_expert_parallel_sizes_train_the_same_model(ep):
    expected_lm, expected_moe = _losses(_run(1))
    lm, moe = _losses(_run(ep))
    assert expected_lm[ITERATIONS] < expected_lm[1], expected_lm
    for iteration in expected_lm:
        assert lm[iteration] == pytest.approx(expected_lm[iteration], rel=1e-5, abs=0), (iteration, lm, expected_lm)
        assert moe[iteration] == pytest.approx(expected_moe[iteration], rel=1e-5, abs=0), (iteration, moe)
    assert f"expert-parallel groups: {[list(range(i, i + ep)) for i in range(0, 4, ep)]}" in _run(ep)


PIPELINE = ("--pipeline-model-parallel-size", "2")
TENSOR = ("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128")


@pytest.mark.parametrize("ep", [2, 4])
def test_tensor_parallel_ranks_share_the_tokens_of_whole_experts(ep):
    """TP 2 x DP 2: each TP rank sends its share of the dispatched tokens to the experts (DeepSpeed's MoE, with
    the gather over gloo done by megatron_ds); EP 2 and EP 4 (runs of ranks across TP) equal EP 1."""
    expected_lm, expected_moe = _losses(_run(1, *TENSOR))
    lm, moe = _losses(_run(ep, *TENSOR))
    for iteration in expected_lm:
        assert lm[iteration] == pytest.approx(expected_lm[iteration], rel=1e-5, abs=0), (iteration, lm, expected_lm)
        assert moe[iteration] == pytest.approx(expected_moe[iteration], rel=1e-5, abs=0), (iteration, moe)
    data_parallel_lm, _ = _losses(_run(1))  # DP 4: the same micro-batches; only TP's rounding differs
    for iteration in data_parallel_lm:
        assert lm[iteration] == pytest.approx(data_parallel_lm[iteration], rel=1e-4), (iteration, lm)
    # the clipping norm counts each expert once: experts differ between TP ranks (DeepSpeed counts the parameters
    # it takes for replicated ones on TP rank 0 only)
    assert _grad_norms(_run(ep, *TENSOR)) == _grad_norms(_run(1))


def test_token_dropping_with_a_capacity_that_tp_does_not_divide():
    """Top-2 of 4 experts over 64 tokens at capacity factor 1.03125: 33 slots per expert, a few tokens dropped.
    DeepSpeed splits the slots over the TP ranks and fails when TP does not divide them; megatron_ds pads them,
    so TP 2 x DP 2 drops the same tokens as DP 4 and gives its losses."""
    dropping = [flag for flag in MOE if flag != "--disable-moe-token-dropping"] + [
        "--moe-train-capacity-factor", "1.03125", "--moe-eval-capacity-factor", "1.03125"]
    expected = launch(4, COMMON + dropping)
    observed = launch(4, COMMON + dropping + list(TENSOR))
    assert_succeeded(expected, tail=3000)
    assert_succeeded(observed, tail=3000)
    expected_lm, _ = _losses(expected.stdout)
    lm, _ = _losses(observed.stdout)
    for iteration in expected_lm:
        assert lm[iteration] == pytest.approx(expected_lm[iteration], rel=1e-4), (iteration, lm, expected_lm)
    assert expected_lm != _losses(_run(1))[0]  # tokens were dropped: not the no-drop run's losses


def _grad_norms(output):
    return re.findall(r" iteration\s+\d+/\s*\d+ \|.*? grad norm: (\S+) \|", output)


@pytest.mark.parametrize("ep", [2])  # EP 1 at PP 2: resumed in test_resume_at_pp2_ep2_...
def test_moe_layers_in_pipeline_stages_train_the_same_model(ep):
    expected_lm, expected_moe = _losses(_run(1))
    lm, moe = _losses(_run(ep, *PIPELINE))
    for iteration in expected_lm:
        assert lm[iteration] == pytest.approx(expected_lm[iteration], rel=1e-5, abs=0), (iteration, lm, expected_lm)
        assert moe[iteration] == pytest.approx(expected_moe[iteration], rel=1e-5, abs=0), (iteration, moe)


def test_bf16_tracks_fp32():
    expected, _ = _losses(_run(2))
    observed, _ = _losses(_run(2, "--bf16"))
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=2e-2), (iteration, observed, expected)


def test_resume_at_pp2_ep2_is_bitwise_and_other_layouts_train_on(tmp_path):
    """Saved at PP 2 x DP 2 x EP 2 (DeepSpeed's expert files): resumed there, bitwise; resumed at EP 1, and
    reshaped by tools/convert_checkpoint.py to TP 2 x PP 1 then resumed at EP 2, the same losses within 1e-5."""
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "5", *PIPELINE]
    first = launch(4, COMMON + MOE + ["--moe-expert-parallel-size", "2", "--exit-interval", "5", *save])
    assert_succeeded(first, tail=4000)
    resumed = launch(4, COMMON + MOE + ["--moe-expert-parallel-size", "2", "--load", str(tmp_path / "ckpt"), *save])
    assert_succeeded(resumed, tail=4000)
    assert "resuming at iteration 5" in resumed.stdout, resumed.stdout[-4000:]
    straight_lm, straight_moe = _losses(_run(2, *PIPELINE))
    lm, moe = losses(first.stdout), {int(i): float(x) for i, x in MOE_LOSS.findall(first.stdout + resumed.stdout)}
    lm.update(losses(resumed.stdout))
    assert lm == straight_lm and moe == straight_moe

    from megatron_ds.conversion.convert_cli import main as convert
    assert convert(["--load", str(tmp_path / "ckpt"), "--load-iteration", "5", "--save", str(tmp_path / "tp2"),
                    "--target-tensor-parallel-size", "2", "--target-pipeline-model-parallel-size", "1",
                    "--target-expert-parallel-size", "2"]) == 0
    for flags in (["--moe-expert-parallel-size", "1", "--load", str(tmp_path / "ckpt"), "--load-iteration", "5",
                   *PIPELINE],
                  ["--moe-expert-parallel-size", "2", "--load", str(tmp_path / "tp2"), *TENSOR]):
        other = launch(4, COMMON + MOE + flags)
        assert_succeeded(other, tail=4000)
        assert "resuming at iteration 5" in other.stdout, other.stdout[-4000:]
        other_lm, other_moe = _losses(other.stdout, range(6, ITERATIONS + 1))
        for iteration in other_lm:
            assert other_lm[iteration] == pytest.approx(lm[iteration], rel=1e-5, abs=0), (flags, other_lm, lm)
            assert other_moe[iteration] == pytest.approx(moe[iteration], rel=1e-5, abs=0), (flags, other_moe, moe)



def test_experts_split_over_tensor_parallel_ranks_train_the_same_model_and_reshape(tmp_path):
    """--enable-expert-tensor-parallelism at TP 2 x DP 2, EP 2 (runs of DP ranks): each expert split over TP like
    the dense MLP gives DP 4's losses and gradient norms (DeepSpeed counts the sharded experts on every TP rank,
    fc2's replicated bias once). Without token dropping DeepSpeed does not round the capacity to a multiple of TP
    for sharded experts; megatron_ds pads the token slots for the TP split. Saved at iteration 5 (expert shards in
    DeepSpeed's files), reshaped to TP 1 and resumed at DP 4 x EP 2, it trains on with the same losses; loaded
    at TP 2 without the flag (whole experts), it is resharded on load and trains on with the same losses."""
    sharded = MOE + [*TENSOR, "--enable-expert-tensor-parallelism", "--moe-expert-parallel-size", "2"]
    result = launch(4, COMMON + sharded + ["--save", str(tmp_path / "ckpt"), "--save-interval", "5"])
    assert_succeeded(result, tail=4000)
    assert "expert-parallel groups: [[0, 2], [1, 3]]" in result.stdout, result.stdout[-4000:]
    lm, moe = _losses(result.stdout)
    expected_lm, expected_moe = _losses(_run(1))
    for iteration in expected_lm:
        assert lm[iteration] == pytest.approx(expected_lm[iteration], rel=1e-5, abs=0), (iteration, lm, expected_lm)
        assert moe[iteration] == pytest.approx(expected_moe[iteration], rel=1e-5, abs=0), (iteration, moe)
    assert _grad_norms(result.stdout) == _grad_norms(_run(1))

    whole = launch(4, COMMON + MOE + [*TENSOR, "--moe-expert-parallel-size", "2", "--load", str(tmp_path / "ckpt"),
                                      "--load-iteration", "5"])
    assert_succeeded(whole, tail=4000)
    assert "resharded to TP 2 x PP 1" in whole.stdout, whole.stdout[-4000:]
    whole_lm, _ = _losses(whole.stdout, range(6, ITERATIONS + 1))
    for iteration in whole_lm:
        assert whole_lm[iteration] == pytest.approx(lm[iteration], rel=1e-5, abs=0), (whole_lm, lm)

    from megatron_ds.conversion.convert_cli import main as convert
    assert convert(["--load", str(tmp_path / "ckpt"), "--load-iteration", "5", "--save", str(tmp_path / "tp1"),
                    "--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
    resumed = launch(4, COMMON + MOE + ["--moe-expert-parallel-size", "2", "--load", str(tmp_path / "tp1")])
    assert_succeeded(resumed, tail=4000)
    assert "resuming at iteration 5" in resumed.stdout, resumed.stdout[-4000:]
    resumed_lm, resumed_moe = _losses(resumed.stdout, range(6, ITERATIONS + 1))
    for iteration in resumed_lm:
        assert resumed_lm[iteration] == pytest.approx(lm[iteration], rel=1e-5, abs=0), (resumed_lm, lm)
        assert resumed_moe[iteration] == pytest.approx(moe[iteration], rel=1e-5, abs=0), (resumed_moe, moe)
