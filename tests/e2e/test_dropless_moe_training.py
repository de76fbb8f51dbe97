"""The dropless MoE layer through pretrain.py (Megatron-Core's MoE flags) on real ranks: a LLaMA-style model with
4 experts, top-2, the expert bias and a balance loss trains the same at every expert-parallel size, with Megatron's
sequence parallelism, and in DeepSpeed's pipeline engine under 1F1B, ZB-H1 and DualPipeV (fp32, dropout 0): the lm
loss, the balance loss and the load of each iteration equal EP 1's at the same data-parallel size (DP 2; EP 2 and 4
at DP 4 against EP 1 at DP 4), and with full recompute; bf16 tracks fp32; the allgather dispatcher trains the same
model as the alltoall one; each MoE layer's load goes to TensorBoard."""
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS

DROPLESS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff",
            "0.01", "--moe-router-enable-expert-bias", "--moe-grouped-gemm"]
BALANCE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? load balancing loss: (\S+) \| tokens per expert max/mean: "
                     r"(\S+) \|")
_runs = {}


def _run(ranks, *flags):
    key = (ranks, flags)
    if key not in _runs:
        result = launch(ranks, COMMON + FAMILIES["llama"] + DROPLESS + list(flags))
        assert_succeeded(result, tail=4000)
        _runs[key] = result.stdout
    return _runs[key]


def _trajectory(output):
    lm = losses(output)
    balance = {int(i): (float(loss), float(load)) for i, loss, load in BALANCE.findall(output)}
    assert sorted(lm) == sorted(balance) == list(range(1, ITERATIONS + 1)), output[-3000:]
    return lm, balance


def _assert_same_training(output, reference):
    lm, balance = _trajectory(output)
    expected_lm, expected_balance = _trajectory(reference)
    assert expected_lm[ITERATIONS] < expected_lm[1], expected_lm
    for iteration in expected_lm:
        assert lm[iteration] == pytest.approx(expected_lm[iteration], rel=1e-5, abs=0), (iteration, lm, expected_lm)
        assert balance[iteration][0] == pytest.approx(expected_balance[iteration][0], rel=1e-5), (iteration, balance)
        assert balance[iteration][1] == pytest.approx(expected_balance[iteration][1], rel=1e-5), (iteration, balance)


def test_expert_parallelism_over_data_parallel_ranks_trains_the_same_model():
    output = _run(2, "--expert-model-parallel-size", "2")
    _assert_same_training(output, _run(2))
    # by hand: embedding and untied head 2 x 256 x 64; per layer two norms 2 x 64, QKV (64 + 2 x 32) x 64 (GQA 2 of
    # 4 heads of 16), projection 64 x 64, router 4 x 64, experts 4 x 3 x 64 x 48 (2 of them active); final norm 64
    per_layer_dense = 2 * 64 + 128 * 64 + 64 * 64 + 4 * 64
    total = 2 * 256 * 64 + 4 * (per_layer_dense + 4 * 3 * 64 * 48) + 64
    active = 2 * 256 * 64 + 4 * (per_layer_dense + 2 * 3 * 64 * 48) + 64
    assert ("dropless Mixture of Experts: 4 experts of FFN 48 in 4 of 4 layers, top-2 (softmax); 2 experts per "
            f"rank (EP 2); grouped GEMMs; alltoall dispatcher, no token dropped; {total:,} parameters in all, "
            f"{active:,} active per token") in output
    assert "expert-parallel groups: [[0, 1]]" in output


def test_the_allgather_dispatcher_trains_the_same_model_as_the_alltoall_one():
    """EP 2 over DP 2: each rank gathers both ranks' tokens and routing, runs its two experts on the pairs routed to
    them, and gets its own tokens' sums back."""
    expert_parallel = ("--expert-model-parallel-size", "2")
    _assert_same_training(_run(2, *expert_parallel, "--moe-token-dispatcher-type", "allgather"),
                          _run(2, *expert_parallel))


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_sizes_at_data_parallel_4_train_the_same_model(ep):
    _assert_same_training(_run(4, "--expert-model-parallel-size", str(ep)), _run(4))


def test_expert_parallelism_across_sequence_parallel_tensor_parallel_ranks_trains_the_same_model():
    """TP 2 with Megatron's SP: each TP rank routes its half of the sequence; EP 2 spans the two TP ranks."""
    _assert_same_training(_run(2, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--make-vocab-size-divisible-by", "128", "--expert-model-parallel-size", "2"), _run(2))


TENSOR_PARALLEL_2 = ("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128")


@pytest.mark.parametrize("ep, sequence_parallel", [(1, True), (2, True), (2, False)],
                         ids=["ep1_sp", "ep2_sp", "ep2_no_sp"])
def test_experts_split_over_the_tensor_parallel_ranks_train_the_same_model(ep, sequence_parallel):
    """Expert TP 2 at TP 2 x DP 2 (Megatron-Core's parallel folding): each TP rank holds half of every expert's F;
    the expert-parallel group is the DP ranks of one TP rank, the rows they receive gathered over TP and the
    partial outputs reduce-scattered back. The same model as TP 1 x EP 1 at DP 2."""
    output = _run(4, *TENSOR_PARALLEL_2, *(["--sequence-parallel"] if sequence_parallel else []),
                  "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", "2")
    assert f"experts per rank (EP {ep}), each split over TP 2 (--expert-tensor-parallel-size)" in output
    _assert_same_training(output, _run(2))


@pytest.mark.parametrize("layout", [("--pipeline-model-parallel-size", "2"),
                                    ("--ds-sequence-parallel-size", "2", "--expert-model-parallel-size", "2")],
                         ids=["pp2", "ulysses2_ep2"])
def test_experts_split_over_the_tensor_parallel_ranks_compose_with_the_pipeline_and_ulysses(layout):
    """Expert TP 2 at TP 2 with Megatron SP, inside DeepSpeed's pipeline stages (PP 2) or with Ulysses 2 (EP 2 over
    the Ulysses ranks, each routing its part of the sequence): the same model as TP 1 x EP 1 at DP 2."""
    output = _run(4, *TENSOR_PARALLEL_2, "--sequence-parallel", "--expert-tensor-parallel-size", "2", *layout)
    assert "each split over TP 2 (--expert-tensor-parallel-size)" in output
    _assert_same_training(output, _run(2))


def test_expert_parallelism_across_ulysses_ranks_trains_the_same_model():
    """Ulysses SP 2: each rank routes half of every sequence; the balance losses' counts are summed over the two
    (as Megatron-Core sums them over CP) and their gradients scaled like the lm loss's."""
    _assert_same_training(_run(2, "--ds-sequence-parallel-size", "2", "--expert-model-parallel-size", "2"), _run(2))


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "dualpipev"])
def test_pipeline_schedules_train_the_same_model(schedule):
    """PP 2 at DP 1: the MoE layers inside DeepSpeed's pipeline stages; ZB-H1 and DualPipeV defer the experts'
    weight gradients as every other weight's."""
    _assert_same_training(_run(2, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule), _run(2))



def test_full_and_selective_recompute_train_the_same_model_and_bf16_tracks_fp32():
    """A recomputed layer routes its tokens twice (its counts double, their balance does not change); selective
    recompute (the attention core) leaves the MoE layer alone; bf16 through DeepSpeed's BF16_Optimizer with the
    experts' parameter groups."""
    reference = _run(2)
    for granularity in ("full", "selective"):
        _assert_same_training(_run(2, "--expert-model-parallel-size", "2", "--recompute-granularity", granularity),
                              reference)
    sixteen_bit, full = losses(_run(2, "--expert-model-parallel-size", "2", "--bf16")), losses(reference)
    assert sorted(sixteen_bit) == list(range(1, ITERATIONS + 1))
    for iteration in full:
        assert sixteen_bit[iteration] == pytest.approx(full[iteration], rel=1e-3), (iteration, sixteen_bit, full)


def test_no_token_is_dropped_in_any_iteration():
    """The experts compute every token of the global batch (8 samples x 32 tokens) twice (top-2) in every layer,
    every iteration, across EP 2 with TP 2 and SP (the rows each rank's experts computed, summed over the ranks);
    the expert bias, moved every step, stays the same on both ranks."""
    result = launch(2, COMMON + FAMILIES["llama"] + DROPLESS + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "128",
        "--expert-model-parallel-size", "2"], program=("-m", "tests.support.expert_choices"))
    assert_succeeded(result, tail=4000)
    choices = re.findall(r"expert rows: \[([0-9, ]+)\]", result.stdout)
    assert len(choices) == ITERATIONS, result.stdout[-3000:]
    assert all([int(count) for count in line.split(",")] == [8 * 32 * 2] * 4 for line in choices), choices
    biases = [(float(size), float(spread)) for size, spread in
              re.findall(r"expert bias: largest \|bias\| (\S+), spread over the stage's ranks (\S+)", result.stdout)]
    assert len(biases) == ITERATIONS and biases[-1][0] > 0, biases  # the bias moved
    assert all(spread == 0 for _, spread in biases), biases  # and is the same on every rank


def _loads(bias):
    """50 iterations of 8 experts, sigmoid top-2, with the routers skewed toward their first two experts: each
    iteration's max/mean load (64 samples x 32 tokens a step: 512 choices per expert when balanced). Micro-batches of
    8, not COMMON's 2: the same loads in half the time."""
    flags = [*COMMON, *FAMILIES["llama"], "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
             "32", "--moe-router-score-function", "sigmoid", "--moe-router-bias-update-rate", "0.002",
             "--moe-grouped-gemm", "--expert-model-parallel-size", "2", "--train-iters", "50", "--global-batch-size",
             "64", "--micro-batch-size", "8", *(["--moe-router-enable-expert-bias"] if bias else [])]
    result = launch(2, flags, program=("-m", "tests.support.skewed_router", "0.2"))
    assert_succeeded(result, tail=4000)
    loads = [float(load) for load in re.findall(r"tokens per expert max/mean: (\S+) \|", result.stdout)]
    assert len(loads) == 50, result.stdout[-3000:]
    return loads


def test_the_expert_bias_balances_a_skewed_router_and_nothing_else_does():
    with_bias, without = _loads(bias=True), _loads(bias=False)
    assert with_bias[0] == without[0] > 2.5, (with_bias[:3], without[:3])  # the skew, before any update
    assert min(with_bias) < 1.2 and sorted(with_bias[-10:])[5] < 1.3, with_bias
    assert min(without) > 1.5, without


def test_each_moe_layers_load_goes_to_tensorboard(tmp_path):
    """PP 2 with MoE layers 0, 2 and 3 of 4 and a capacity: every log interval, each MoE layer's max/mean load as
    moe/tokens_per_expert_max_over_mean_layer_{i} (0-based, layer 0's from the first stage), the largest of them
    the iteration line's."""
    result = launch(2, COMMON + FAMILIES["llama"] + DROPLESS + [
        "--pipeline-model-parallel-size", "2", "--moe-layer-freq", "[1,0,1,1]", "--moe-expert-capacity-factor", "1.0",
        "--train-iters", "3", "--tensorboard-dir", str(tmp_path)])
    assert_succeeded(result, tail=4000)
    scalars = _tensorboard_scalars(tmp_path)
    layers = {tag: values for tag, values in scalars.items() if tag.startswith("moe/")}
    assert sorted(layers) == [f"moe/tokens_per_expert_max_over_mean_layer_{index}" for index in (0, 2, 3)], scalars
    line = {int(iteration): float(load) for iteration, _, load in BALANCE.findall(result.stdout)}
    assert sorted(line) == [1, 2, 3] == sorted(scalars["tokens per expert max/mean"]), result.stdout[-3000:]
    for iteration, load in line.items():
        assert max(values[iteration] for values in layers.values()) == pytest.approx(load, abs=5e-4), (iteration,
                                                                                                         layers)
        assert all(values[iteration] >= 1 for values in layers.values()), layers


def _tensorboard_scalars(folder):
    """{tag: {step: value}} of the TensorBoard event files in folder."""
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}
