"""DeepSpeed-Ulysses sequence parallelism (--ds-sequence-parallel-size) through pretrain.py on 4 real ranks: each
rank holds 1/SP of every sample's tokens and attention swaps them for heads with DeepSpeed's DistributedAttention.
The lm loss over 10 iterations (fp32, dropout 0) is within 1e-4 of the TP 1 x SP 1 x PP 1 run at SP 2, SP 4,
TP 2 x SP 2 (with and without Megatron's --sequence-parallel) and SP 2 x PP 2, for the GPT-2 family and for the
LLaMA family (RoPE at each token's global position; 2 key/value heads, fewer than the 4 SP ranks at SP 4; with
--eod-mask-loss and --reset-position-ids);
checkpoints saved at SP 2 resume at SP 1 and the reverse."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON, FAMILIES, ITERATIONS, SCHEDULE_FLAGS

WORLD = 4
LLAMA_DOCUMENTS = ("--eod-mask-loss", "--reset-position-ids")
_runs = {}
_SAVES = None  # a folder for this module's checkpoints


def _run(family, tp=1, sp=1, pp=1, *extra):
    """Per-iteration losses, output and checkpoint folder (saved at iteration 5 and 10) of one 4-rank launch;
    memoized."""
    key = (family, tp, sp, pp, extra)
    if key not in _runs:
        save = _SAVES / "-".join(map(str, key))
        flags = COMMON + FAMILIES[family] + [
            "--tensor-model-parallel-size", str(tp), "--ds-sequence-parallel-size", str(sp),
            "--pipeline-model-parallel-size", str(pp), "--make-vocab-size-divisible-by", str(256 // tp), *extra,
            "--save", str(save), "--save-interval", "5"]
        result = launch(WORLD, flags)
        assert_succeeded(result, tail=4000)
        _runs[key] = losses(result.stdout), result.stdout, save
    return _runs[key]


@pytest.fixture(scope="module", autouse=True)
def _saves(tmp_path_factory):
    global _SAVES
    _SAVES = tmp_path_factory.mktemp("ulysses")


def _assert_close(observed, expected, iterations=range(1, ITERATIONS + 1)):
    assert sorted(observed) == list(iterations), observed
    for iteration in iterations:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-4), (iteration, observed, expected)


@pytest.mark.parametrize("family, tp, sp, pp, extra", [
    ("gpt2", 1, 2, 1, ()),
    ("gpt2", 2, 2, 1, ()),
    ("gpt2", 1, 2, 2, ()),
    ("gpt2", 2, 2, 1, ("--sequence-parallel",)),
    ("llama", 1, 2, 1, ()),
    ("llama", 1, 4, 1, ()),
], ids=["sp2", "tp2-sp2", "sp2-pp2", "tp2-sp2-megatron-sp", "llama-gqa-sp2", "llama-gqa-sp4"])
def test_sequence_parallel_layouts_train_the_same_model(family, tp, sp, pp, extra):
    """The LLaMA runs also reset the positions at each end of document and mask its loss: positions and loss
    mask are cut with the tokens, and the loss counts the masked tokens over the whole sequence."""
    shared = LLAMA_DOCUMENTS if family == "llama" else ()
    expected, _, _ = _run(family, 1, 1, 1, *shared)
    observed, output, _ = _run(family, tp, sp, pp, *shared, *extra)
    assert expected[ITERATIONS] < expected[1], expected
    _assert_close(observed, expected)
    assert f"SP {sp} x PP {pp}" in output and "sequence-parallel groups:" in output, output[-3000:]


@pytest.mark.parametrize("saved_sp, resumed_sp", [(2, 1), (1, 2)], ids=["sp2-to-sp1", "sp1-to-sp2"])
def test_checkpoints_resume_at_another_sequence_parallel_size(saved_sp, resumed_sp):
    """Weights are replicated over the SP ranks and DeepSpeed's ZeRO partitions span SP x DP: a checkpoint saved
    at iteration 5 of the SP run resumes at the other SP size with the same losses."""
    straight, _, saved = _run("gpt2", 1, saved_sp, 1)
    flags = COMMON + FAMILIES["gpt2"] + ["--ds-sequence-parallel-size", str(resumed_sp), "--load", str(saved),
                                         "--load-iteration", "5", "--make-vocab-size-divisible-by", "256"]
    resumed = launch(WORLD, flags)
    assert_succeeded(resumed, tail=4000)
    assert "resuming at iteration 5" in resumed.stdout, resumed.stdout[-4000:]
    _assert_close(losses(resumed.stdout), straight, range(6, ITERATIONS + 1))


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev", "interleaved"])
def test_the_pipeline_schedules_run_ulysses_inside_their_stages(schedule):
    """SP 2 x PP 2 (4 micro-batches): ZB-H1 and the zero-bubble DualPipeV, whose split backwards run the Ulysses
    all-to-alls of each stage, and interleaved train what 1F1B trains (ZB-H1 bitwise, the others to the rounding
    of another order of summing the micro-batches' weight gradients)."""
    expected, _, _ = _run("gpt2", 1, 2, 2)
    observed, _, _ = _run("gpt2", 1, 2, 2, *SCHEDULE_FLAGS[schedule])
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), observed
    for iteration in expected:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=0 if schedule == "zbh1" else 1e-5,
                                                    abs=0), (iteration, observed, expected)
