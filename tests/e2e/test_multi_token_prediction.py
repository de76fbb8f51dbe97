"""Multi-token prediction (--mtp-num-layers 1) through pretrain.py on real ranks, LLaMA family (untied head: the last
stage holds its own copy of the embedding for the tokens ahead), fp32, dropout 0: TP 2 with --sequence-parallel,
PP 2 under 1F1B and DualPipeV (the head, and the MTP module, on the first rank) and Ulysses 2 give the lm loss and the
mtp loss of each of 10 iterations of the single-rank run within 1e-5, also with a --pipeline-model-parallel-layout
that leaves DualPipeV's last model stage only the MTP module and the loss; the MTP gradient changes the lm loss (weight
0.1) and does not with weight 0. A checkpoint saved at PP 2 holds the MTP module and resumes at TP 2 + SP. With the
dropless MoE the module's layer is an MoE layer (DeepSeek-V3's case): EP 2 and PP 2 under DualPipeV train as EP 1,
and a checkpoint saved at EP 2 resumes at PP 2."""
import re

import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS, run_layout, run_layout_output

MTP = ["--mtp-num-layers", "1"]
MTP_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? mtp loss: (\S+) \|")
LAYOUTS = {"tp2-sp": ((2, 1, 1), ["--sequence-parallel"]),
           "pp2-1f1b": ((1, 2, 1), []),
           "pp2-dualpipev": ((1, 2, 1), ["--pipeline-schedule", "dualpipev"]),
           # the last model stage (rank 0's second) holds the MTP module and the head, no layer of the model
           "pp2-dualpipev-layout": ((1, 2, 1), ["--pipeline-schedule", "dualpipev",
                                                "--pipeline-model-parallel-layout", "Et|tt|t|mL"]),
           "ulysses2": ((1, 1, 2), ["--ds-sequence-parallel-size", "2"])}


def _mtp_losses(output):
    found = {int(iteration): float(loss) for iteration, loss in MTP_LOSS.findall(output)}
    assert sorted(found) == list(range(1, ITERATIONS + 1)), output[-3000:]
    return found


def _assert_close(observed, expected, start=1):
    for iteration in range(start, ITERATIONS + 1):
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-5, abs=0), \
            (iteration, observed, expected)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_trains_the_same_at_every_layout(name):
    (tp, pp, dp), extra = LAYOUTS[name]
    expected = run_layout_output("llama", 1, 1, 1, MTP)
    observed = run_layout_output("llama", tp, pp, dp, MTP + extra)
    _assert_close(losses(observed), losses(expected))
    _assert_close(_mtp_losses(observed), _mtp_losses(expected))


def test_the_mtp_gradient_joins_the_main_one_by_its_weight():
    with_mtp, plain = run_layout("llama", 1, 1, 1, MTP), run_layout("llama", 1, 1, 1)
    assert with_mtp[1] == plain[1]  # the lm loss logged is the main model's
    assert any(with_mtp[i] != pytest.approx(plain[i], rel=1e-5) for i in range(2, ITERATIONS + 1))
    weightless = run_layout("llama", 1, 1, 1, MTP + ["--mtp-loss-scaling-factor", "0"])
    _assert_close(weightless, plain)


def test_a_pp2_checkpoint_holds_the_mtp_module_and_resumes_at_tp2(tmp_path):
    llama = COMMON + FAMILIES["llama"] + MTP
    folder = tmp_path / "checkpoint"
    saved = launch(2, llama + ["--pipeline-model-parallel-size", "2", "--save", str(folder), "--exit-interval", "5"])
    assert_succeeded(saved, tail=4000)
    resumed = launch(2, llama + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--make-vocab-size-divisible-by", "128", "--load", str(folder)])
    assert_succeeded(resumed, tail=4000)
    straight = run_layout_output("llama", 1, 1, 1, MTP)
    assert sorted(losses(resumed.stdout)) == list(range(6, ITERATIONS + 1)), resumed.stdout[-3000:]
    _assert_close(losses(resumed.stdout), losses(straight), start=6)
    resumed_mtp = {i: loss for i, loss in MTP_LOSS.findall(resumed.stdout)}
    _assert_close({int(i): float(loss) for i, loss in resumed_mtp.items()}, _mtp_losses(straight), start=6)


DROPLESS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff",
            "0.01", "--moe-router-enable-expert-bias", "--moe-grouped-gemm"]
_dropless_runs = {}


def _dropless(*flags, nproc=2):
    key = (nproc, flags)
    if key not in _dropless_runs:
        result = launch(nproc, COMMON + FAMILIES["llama"] + MTP + DROPLESS + list(flags))
        assert_succeeded(result, tail=4000)
        _dropless_runs[key] = result.stdout
    return _dropless_runs[key]


@pytest.mark.parametrize("flags", [("--expert-model-parallel-size", "2"),
                                   ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev")],
                         ids=["ep2", "pp2-dualpipev"])
def test_an_moe_models_mtp_module_has_an_moe_layer_that_trains_the_same_at_every_layout(flags):
    """DeepSeek-V3's case: the MTP module's layer is a dropless MoE layer like the model's last, its experts
    balanced by the expert bias with the others' and its balance loss counted with theirs."""
    expected, observed = _dropless(), _dropless(*flags)
    _assert_close(losses(observed), losses(expected))
    _assert_close(_mtp_losses(observed), _mtp_losses(expected))
    balance = re.compile(r" iteration\s+10/.*? load balancing loss: (\S+) \|.*? tokens per expert max/mean: (\S+) \|")
    (observed_balance, observed_load), = balance.findall(observed)
    (expected_balance, expected_load), = balance.findall(expected)
    assert float(observed_balance) == pytest.approx(float(expected_balance), rel=1e-5)
    assert observed_load == expected_load


def test_an_moe_mtp_checkpoint_saved_at_ep2_resumes_at_pp2(tmp_path):
    folder = tmp_path / "checkpoint"
    saved = launch(2, COMMON + FAMILIES["llama"] + MTP + DROPLESS + [
        "--expert-model-parallel-size", "2", "--save", str(folder), "--exit-interval", "5"])
    assert_succeeded(saved, tail=4000)
    assert (folder / "global_step5" / "layer_4_expert_3_mp_rank_00_model_states.pt").exists()  # the MTP layer's
    resumed = launch(2, COMMON + FAMILIES["llama"] + MTP + DROPLESS + [
        "--pipeline-model-parallel-size", "2", "--load", str(folder)])
    assert_succeeded(resumed, tail=4000)
    straight = _dropless()
    assert sorted(losses(resumed.stdout)) == list(range(6, ITERATIONS + 1)), resumed.stdout[-3000:]
    _assert_close(losses(resumed.stdout), losses(straight), start=6)
    _assert_close({int(i): float(loss) for i, loss in MTP_LOSS.findall(resumed.stdout)}, _mtp_losses(straight),
                  start=6)
