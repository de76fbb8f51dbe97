"""Sequence parallelism and every recompute mode change no number: the lm loss of each of 10 iterations
equals the same run without them (fp32; within 1e-5 without dropout, identical with dropout 0.1 and
recompute), at (tp, pp, dp) = (2,1,1) and (2,2,2), through the real launcher."""
import pytest

from tests.layouts import ITERATIONS, run_layout

pytestmark = pytest.mark.e2e  # launches several real processes

SELECTIVE = ["--recompute-activations"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
FULL_BLOCK_DISTRIBUTED = ["--recompute-granularity", "full", "--recompute-method", "block",
                          "--recompute-num-layers", "1", "--distribute-saved-activations"]
SP = ["--sequence-parallel"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend", "local"]

CASES = {
    (2, 1, 1): {"sp": SP, "selective": SELECTIVE, "full-uniform": FULL_UNIFORM,
                "full-block-distributed": FULL_BLOCK_DISTRIBUTED},
    (2, 2, 2): {"sp-selective": SP + SELECTIVE, "sp-full-uniform": SP + FULL_UNIFORM},
}


def _baseline(family, layout, extra=()):
    return run_layout(family, *layout, list(extra))


@pytest.mark.parametrize("layout,name,flags", [(layout, name, flags) for layout, cases in CASES.items()
                                               for name, flags in cases.items()],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else (v if isinstance(v, str) else None))
def test_memory_savers_leave_losses_unchanged(layout, name, flags):
    family = "llama" if "full" in name else "gpt2"
    expected, observed = _baseline(family, layout), run_layout(family, *layout, flags)
    assert sorted(observed) == list(range(1, ITERATIONS + 1))
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5), (iteration, observed, expected)


@pytest.mark.parametrize("base,recompute", [([], SELECTIVE), ([], FULL_UNIFORM), (SP, SP + FULL_BLOCK_DISTRIBUTED[:-1])],
                         ids=["selective", "full", "sp-full"])
def test_recompute_with_dropout_is_identical(base, recompute):
    """Dropout masks are replayed exactly in recompute (the RNG tracker states are restored)."""
    expected = _baseline("gpt2", (2, 1, 1), DROPOUT + base)
    observed = run_layout("gpt2", 2, 1, 1, DROPOUT + recompute)
    assert observed == expected
