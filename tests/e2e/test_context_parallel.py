"""Context parallelism (--context-parallel-size, --cp-comm-type p2p | allgather) through pretrain.py on real ranks:
each rank holds chunks i and 2 CP - 1 - i of every sample, attention brings the other ranks' keys and values round
the ring (or gathers them), RoPE turns each token at its global position. Over 10 iterations (fp32, dropout 0) the
lm loss is within 1e-4 of CP 1's for the GPT-2 family (learned positions) and a LLaMA with one key/value head
(which Ulysses could not split past TP; here sent round the ring unexpanded) at CP 2 and CP 4, p2p and allgather,
and at CP 2 with TP 2 and Megatron SP, with PP 2 under 1F1B, ZB-H1, DualPipeV and interleaved, with selective
recompute, inside Ulysses 2 (Megatron-LM's a2a+p2p), with multi-latent attention and multi-token prediction at CP 4,
and with the dropless MoE layer at EP 2. With dropout 0.1 (every mask keyed by global position: the hidden and embedding
dropouts' rows, the attention's query and key) CP 2 trains like CP 1, recompute replays it bitwise, and a checkpoint
saved at CP 2 resumes at CP 2 bitwise and at CP 1 and CP 4 within 1e-4 of the straight run."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS

ONE_KV_HEAD = FAMILIES["llama"][:-2] + ["--num-key-value-heads", "1"]
FAMILY_FLAGS = {"gpt2": FAMILIES["gpt2"], "llama-1kv": ONE_KV_HEAD, "mla": FAMILIES["mla"]}
DROPLESS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff",
            "0.01", "--moe-grouped-gemm", "--expert-model-parallel-size", "2"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend", "flash"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
_runs = {}
_SAVES = None  # this module's checkpoint folder


@pytest.fixture(scope="module", autouse=True)
def _saves(tmp_path_factory):
    global _SAVES
    _SAVES = tmp_path_factory.mktemp("context-parallel")


def _run(ranks, family, *flags):
    """Per-iteration losses and output of one launch; memoized."""
    key = (ranks, family, flags)
    if key not in _runs:
        result = launch(ranks, COMMON + FAMILY_FLAGS[family] + ["--make-vocab-size-divisible-by", "128", *flags])
        assert_succeeded(result, tail=4000)
        _runs[key] = losses(result.stdout), result.stdout
    return _runs[key]


def _assert_close(observed, expected):
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), observed
    assert expected[ITERATIONS] < expected[1], expected
    for iteration in expected:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-4), (iteration, observed, expected)


@pytest.mark.parametrize("family", ["gpt2", "llama-1kv"])
@pytest.mark.parametrize("cp, comm", [(2, "p2p"), (4, "p2p"), (2, "allgather"), (4, "allgather")])
def test_context_parallel_sizes_train_the_same_model(family, cp, comm):
    expected, _ = _run(1, family)
    observed, output = _run(cp, family, "--context-parallel-size", str(cp), "--cp-comm-type", comm)
    _assert_close(observed, expected)
    assert f"CP {cp} ({comm}) x PP 1" in output and "context-parallel groups:" in output, output[-3000:]


@pytest.mark.parametrize("flags", [
    ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"),
    ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbh1"),
    ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"),
    ("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
    ("--ds-sequence-parallel-size", "2"),
    ("--recompute-activations",),
], ids=["tp2-megatron-sp", "pp2-1f1b", "pp2-zbh1", "pp2-dualpipev", "pp2-interleaved", "ulysses2", "selective"])
def test_context_parallel_composes_with_the_other_layouts(flags):
    expected, _ = _run(1, "gpt2")
    ranks = 2 if flags == ("--recompute-activations",) else 4
    observed, output = _run(ranks, "gpt2", "--context-parallel-size", "2", *flags)
    _assert_close(observed, expected)


def test_context_parallel_carries_multi_latent_attention_and_multi_token_prediction():
    """DeepSeek-V3's attention (its own value head dim, YaRN at global positions) and an MTP module, whose tokens
    ahead of a rank's positions lie in the other ranks' chunks."""
    expected, _ = _run(1, "mla", "--mtp-num-layers", "1")
    observed, _ = _run(4, "mla", "--mtp-num-layers", "1", "--context-parallel-size", "4")
    _assert_close(observed, expected)


def test_a2a_p2p_is_ulysses_inside_the_ring():
    """Megatron-LM's hierarchical CP: 2 adjacent ranks in Ulysses' all-to-all, a ring of 2 of those groups."""
    expected, _ = _run(1, "llama-1kv")
    observed, output = _run(4, "llama-1kv", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                            "--hierarchical-context-parallel-sizes", "2", "2")
    _assert_close(observed, expected)
    assert "SP 2 x CP 2 (p2p) x PP 1" in output, output[-3000:]
    assert "sequence-parallel groups: [[0, 1], [2, 3]]" in output and "context-parallel groups: [[0, 2], [1, 3]]" \
        in output, output[-3000:]


def test_context_parallel_routes_each_ranks_tokens_through_the_dropless_moe_layer():
    """EP 2: at CP 1 over the 2 data-parallel ranks, at CP 2 over the 2 CP ranks of each of 2 data-parallel
    replicas (4 ranks); the tokens of a CP rank are routed like any other's."""
    expected, _ = _run(2, "llama-1kv", *DROPLESS)
    observed, _ = _run(4, "llama-1kv", *DROPLESS, "--context-parallel-size", "2")
    _assert_close(observed, expected)


def _saved_at_cp2():
    """The straight CP 2 run with dropout, saving at iterations 5 and 10: (losses, its checkpoint folder)."""
    save = _SAVES / "cp2-dropout"
    observed, _ = _run(2, "llama-1kv", *DROPOUT, "--context-parallel-size", "2", "--save", str(save),
                       "--save-interval", "5")
    return observed, save


def test_dropout_masks_do_not_depend_on_context_parallelism():
    expected, _ = _run(1, "llama-1kv", *DROPOUT)
    observed, _ = _saved_at_cp2()
    _assert_close(observed, expected)


def test_recompute_with_dropout_is_identical_at_cp2():
    expected, _ = _saved_at_cp2()
    observed, _ = _run(2, "llama-1kv", *DROPOUT, "--context-parallel-size", "2", *FULL_RECOMPUTE)
    assert observed == expected


@pytest.mark.parametrize("cp", [2, 1, 4])
def test_a_checkpoint_saved_at_cp2_resumes_at_any_context_parallel_size(cp):
    """CP is not part of the saved layout: the weights are replicated over the CP ranks and DeepSpeed's ZeRO
    partitions (over SP x CP x DP) are resharded on load; at CP 2 the resumed run is the straight one, bitwise."""
    straight, saved = _saved_at_cp2()
    resumed, output = _run(cp, "llama-1kv", *DROPOUT, "--context-parallel-size", str(cp), "--load", str(saved),
                           "--load-iteration", "5")
    assert "resuming at iteration 5" in output, output[-4000:]
    assert sorted(resumed) == list(range(6, ITERATIONS + 1)), resumed
    if cp == 2:
        assert resumed == {iteration: straight[iteration] for iteration in resumed}
    for iteration in resumed:
        assert resumed[iteration] == pytest.approx(straight[iteration], rel=1e-4), (iteration, resumed, straight)
