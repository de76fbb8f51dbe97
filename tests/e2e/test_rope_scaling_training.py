"""Training with YaRN's RoPE scaling (--rope-type yarn, an original context of 16 for a sequence of 32, attention
factor other than 1) at TP 2 with --sequence-parallel gives the lm loss of each of 10 iterations of the TP 1 run
within 1e-5 (fp32, no dropout), through the real launcher; the scaling changes the losses."""
import pytest

from tests.support.layouts import ITERATIONS, run_layout

YARN = ["--rope-type", "yarn", "--rotary-scaling-factor", "4", "--original-max-position-embeddings", "16",
        "--beta-fast", "8", "--beta-slow", "0.5", "--mscale", "2", "--mscale-all-dim", "0.5"]


def test_yarn_at_tp2_with_sequence_parallel_trains_as_tp1():
    expected = run_layout("llama", 1, 1, 1, YARN)
    observed = run_layout("llama", 2, 1, 1, YARN + ["--sequence-parallel"])
    assert sorted(observed) == list(range(1, ITERATIONS + 1))
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5), (iteration, observed, expected)
    plain = run_layout("llama", 1, 1, 1)
    assert any(plain[iteration] != pytest.approx(loss, rel=1e-5) for iteration, loss in expected.items())
