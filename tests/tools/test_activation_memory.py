"""tools/activation_memory.py measures, on real TP and Ulysses ranks, what the paper's formulas predict."""
import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = pytest.mark.e2e  # launches several real processes


def test_measured_activation_bytes_match_the_paper():
    result = subprocess.run([sys.executable, "tools/activation_memory.py", "--hidden-size", "256",
                             "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "2",
                             "--tensor-model-parallel-size", "2"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if " local " in line or " sdpa " in line]
    ratios = {(" ".join(row[:row.index(backend)]), backend): float(row[row.index(backend) + 3])
              for row in rows for backend in ("local", "sdpa") if backend in row}
    assert len(ratios) == 12, result.stdout          # 10 schemes on TP ranks, Ulysses SP 2 and 4
    for (scheme, backend), ratio in ratios.items():
        assert 0.9 <= ratio <= 1.1, (scheme, backend, ratio, result.stdout)
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
    assert result.returncode == 0, result.stderr[-3000:]
    measured = {int(line.split()[2]): int(line.split()[4].replace(",", "")) for line in result.stdout.splitlines()
                if line.startswith("Ulysses SP ")}
    assert sorted(measured) == [2, 4], result.stdout
    for u, saved in measured.items():
        assert saved == pytest.approx(s * b * h * (34 + 5 * a * s / h) / u, rel=0.1), (u, result.stdout)
