"""Sequence parallelism and every recompute mode change no number: the lm loss of each of 10 iterations
equals the same run without them (fp32; within 1e-5 without dropout, identical with dropout 0.1 and
recompute), at (tp, pp, dp) = (2,1,1) and (2,2,1), through the real launcher."""
import pytest

from tests.support.layouts import ITERATIONS, run_layout

SELECTIVE = ["--recompute-activations"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
FULL_BLOCK_DISTRIBUTED = ["--recompute-granularity", "full", "--recompute-method", "block",
                          "--recompute-num-layers", "1", "--distribute-saved-activations"]
SP = ["--sequence-parallel"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend", "local"]
FLASH_DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend", "flash"]

CASES = {
    (2, 1, 1): {"sp": SP, "selective": SELECTIVE, "full-uniform": FULL_UNIFORM,
                "full-block-distributed": FULL_BLOCK_DISTRIBUTED},
    (2, 2, 1): {"sp-selective": SP + SELECTIVE, "sp-full-uniform": SP + FULL_UNIFORM},
}


def _baseline(family, layout, extra=()):
    return run_layout(family, *layout, list(extra))


@pytest.mark.parametrize("layout,name,flags", [(layout, name, flags) for layout, cases in CASES.items()
                                               for name, flags in cases.items()],
                         ids=lambda v: ("x".join(map(str, v)) if isinstance(v, tuple)
                                        else (v if isinstance(v, str) else None)))
def test_memory_savers_leave_losses_unchanged(layout, name, flags):
    family = "llama" if "full" in name else "gpt2"
    expected, observed = _baseline(family, layout), run_layout(family, *layout, flags)
    assert sorted(observed) == list(range(1, ITERATIONS + 1))
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5), (iteration, observed, expected)


@pytest.mark.parametrize("family,dropout,base,recompute", [
    ("gpt2", DROPOUT, [], SELECTIVE), ("gpt2", DROPOUT, [], FULL_UNIFORM),
    ("gpt2", DROPOUT, SP, SP + FULL_BLOCK_DISTRIBUTED[:-1]), ("llama", FLASH_DROPOUT, [], SELECTIVE)],
    ids=["selective", "full", "sp-full", "llama-gqa-flash-selective"])
def test_recompute_with_dropout_is_identical(family, dropout, base, recompute):
    """Dropout masks are replayed exactly in recompute (the RNG tracker states are restored; the flash
    attention op's mask is a hash of a seed drawn from them, here with GQA's key and value heads unexpanded)."""
    expected = _baseline(family, (2, 1, 1), dropout + base)
    observed = run_layout(family, 2, 1, 1, dropout + recompute)
    assert observed == expected
