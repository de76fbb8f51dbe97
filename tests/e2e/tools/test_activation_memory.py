"""tools/activation_memory.py measures, on real TP and Ulysses ranks, what the paper's formulas and the planner
predict."""
import subprocess
import sys

import pytest

from tests.support.launch import REPO, assert_succeeded


def test_measured_activation_bytes_match_the_paper():
    result = subprocess.run([sys.executable, "tools/activation_memory.py", "--hidden-size", "256",
                             "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "2",
                             "--tensor-model-parallel-size", "2"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert_succeeded(result, tail=3000)
    rows = [line.split() for line in result.stdout.splitlines() if " local " in line or " sdpa " in line]
    ratios = {(" ".join(row[:row.index(backend)]), backend): (float(row[row.index(backend) + 3]),
                                                             float(row[row.index(backend) + 5]))
              for row in rows for backend in ("local", "sdpa") if backend in row}
    assert len(ratios) == 12, result.stdout          # 10 schemes on TP ranks, Ulysses SP 2 and 4
    for (scheme, backend), (to_planner, to_paper) in ratios.items():
        assert 0.995 <= to_planner <= 1.005 and 0.9 <= to_paper <= 1.1, (scheme, backend, result.stdout)
    local_tp = next(int(r[r.index("local") + 1].replace(",", "")) for r in rows if r[0] == "TP" and "local" in r)
    sdpa_tp = next(int(r[r.index("sdpa") + 1].replace(",", "")) for r in rows if r[0] == "TP" and "sdpa" in r)
    s, b, a, t = 256, 2, 8, 2
    assert local_tp - sdpa_tp >= 0.9 * 5 * a * s * s * b / t, "sdpa should drop the s^2 attention term"
    measured = {" ".join(r[:r.index("local")]): int(r[r.index("local") + 1].replace(",", "")) for r in rows
                if "local" in r}
    h = 256
    # DeepSpeed's checkpoint keeps the layer input (2sbh), as ours; --partition-activations 1/t of it per rank
    assert measured["DeepSpeed recompute"] == measured["full recompute"] == 2 * s * b * h, result.stdout
    assert 2 * s * b * h / t <= measured["DeepSpeed + partition"] <= 2 * s * b * h / t + 64, result.stdout


def test_ulysses_bytes_per_rank_are_the_unsplit_layers_over_u():
    """DeepSpeed-Ulysses on U real ranks (DeepSpeed's DistributedAttention, s/U tokens each): one rank saves
    s b h (34 + 5as/h) / U bytes; the all-to-alls save nothing of their own."""
    s, b, h, a = 64, 2, 64, 8
    result = subprocess.run([sys.executable, "tools/activation_memory.py", "--hidden-size", str(h),
                             "--num-attention-heads", str(a), "--seq-length", str(s), "--micro-batch-size", str(b),
                             "--scheme", "Ulysses SP 2", "--scheme", "Ulysses SP 4"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert_succeeded(result, tail=3000)
    measured = {int(line.split()[2]): int(line.split()[4].replace(",", "")) for line in result.stdout.splitlines()
                if line.startswith("Ulysses SP ")}
    assert sorted(measured) == [2, 4], result.stdout
    for u, saved in measured.items():
        assert saved == pytest.approx(s * b * h * (34 + 5 * a * s / h) / u, rel=0.1), (u, result.stdout)


@pytest.mark.parametrize("groups", [2, 4], ids=["one-group-per-rank", "two-groups-per-rank"])
def test_measured_llama_layer_bytes_match_the_planner(groups):
    """A LLaMA layer (RMSNorm, SwiGLU, RoPE, GQA, no biases, no dropout) at TP 2 saves what planning/memory.py
    counts from its config: q, k, v as views of the QKV output where a rank holds one query group (beside RoPE's
    rotated q and k), as copies where it holds two; RoPE's fp32 angles; SwiGLU's input and product."""
    result = subprocess.run([sys.executable, "tools/activation_memory.py", "--hidden-size", "256",
                             "--num-attention-heads", "8", "--num-key-value-heads", str(groups), "--seq-length", "256",
                             "--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--swiglu",
                             "--ffn-hidden-size", "704", "--normalization", "RMSNorm",
                             "--use-rotary-position-embeddings", "--disable-bias-linear", "--hidden-dropout", "0",
                             "--attention-dropout", "0", "--scheme", "TP", "--scheme", "TP + SP",
                             "--scheme", "TP + SP + selective"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert_succeeded(result, tail=3000)
    rows = [line.split() for line in result.stdout.splitlines() if " local " in line or " sdpa " in line]
    assert len(rows) == 5, result.stdout             # TP and TP + SP with both backends, selective with local
    for row in rows:
        backend = next(word for word in row if word in ("local", "sdpa"))
        measured, planned = (int(row[row.index(backend) + i].replace(",", "")) for i in (1, 2))
        assert measured == pytest.approx(planned, rel=0.002), (row, result.stdout)


def test_measured_moe_layer_bytes_match_the_planner():
    """An MoE layer (DeepSpeed's MOELayer, 4 experts, top-2, capacity factor 1.5) saves what planning/memory.py
    counts: the gate's fp32 input and routing, the experts' inputs and MLPs over 4 x 384 slots, the combine's."""
    result = subprocess.run([sys.executable, "tools/activation_memory.py", "--num-experts", "4", "--topk", "2",
                             "--moe-train-capacity-factor", "1.5", "--scheme", "no parallelism"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert_succeeded(result, tail=3000)
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("no parallelism")]
    assert len(rows) == 2, result.stdout             # local and sdpa
    for row in rows:
        measured, planned = (int(row[3 + i].replace(",", "")) for i in (0, 1))
        assert measured == pytest.approx(planned, rel=0.001), (row, result.stdout)
