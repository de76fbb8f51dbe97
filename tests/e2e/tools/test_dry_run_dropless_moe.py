"""tools/dry_run.py --step on a model with dropless MoE layers (Megatron-Core's flags): the ranks build and run the
layer on the fake process group, its all-to-all-v sizes are those of uniform routing (the dry run's
AllToAllDispatcher.uniform_routing), and every axis's bytes and the memory peak check against the planner."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.launch import assert_succeeded

REPO = Path(__file__).resolve().parents[3]
# 2 layers, both MoE: 8 experts of FFN 192, top-2, a gated shared expert of FFN 128; TP 2 x DP 2 (no SP: the layer
# splits the tokens over TP and gathers them), EP 2 over each TP pair; micro batch 2 x seq 128, bf16
FLAGS = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
         "--train-iters", "1", "--lr", "1e-4", "--bf16", "--swiglu", "--num-experts", "8", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "192", "--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate",
         "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--world-size", "4"]


def _count(record, op, group, size):
    return sum(1 for entry in record["step"]["ops"]
               if entry["op"] == op and entry["group"] == group and entry["bytes"] == size)


def test_a_dropless_moe_world_steps_as_planned(tmp_path):
    result = subprocess.run([sys.executable, "tools/dry_run.py", *FLAGS, "--jobs", "2", "--step", "--json",
                             str(tmp_path / "dry.json")], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert_succeeded(result, tail=None)
    assert "traffic and memory as planned, memory within the device" in result.stdout
    first = json.loads((tmp_path / "dry.json").read_text())["ranks"]["0"]
    assert first["groups"]["ours"]["expert"] == [0, 1] and first["groups"]["ours"]["expert-data"] == [0, 2]
    iteration_worked_by_hand(first)


def iteration_worked_by_hand(first):
    """Rank 0: 8 / (2 x DP 2) = 2 micro-batches. Each TP rank routes T = 2 x 128 / 2 = 128 tokens, k T = 256 rows of
    128 bf16 = 65,536 bytes; uniform routing gives each of the 8 experts 32 of them, so rank 0 (experts 0-3)
    receives 128 from each of the 2 ranks: 256 rows back too. Per MoE layer and micro-batch: the counts (8 int64),
    the rows out and back, their 2 conjugates."""
    m, layers, p = 2, 2, 65536
    assert _count(first, "alltoall_base", [0, 1], 8 * 8) == m * layers
    rows = [entry for entry in first["step"]["ops"] if entry["op"] == "alltoall_base" and entry.get("splits")]
    assert len(rows) == m * layers * 4 and all(entry["bytes"] == 256 * 128 * 2 for entry in rows)
    assert all(entry["splits"] == [128, 128] and entry["sent"] == 128 * 128 * 2 for entry in rows)
    # TP, P = 2 x 128 x 128 x 2 = 65,536: the layer's gather (forward) and split's gradient (backward) all-gathers;
    # all-reduces: the embedding, attention's 2 and the shared expert's 2 per layer, the head's input gradient;
    # the router's gradient (128 x 8 bf16) in each backward beside the cross entropy's sums (2 x 256 fp32)
    assert _count(first, "allgather", [0, 1], p) == m * layers * 2
    assert _count(first, "allreduce", [0, 1], p) == m * (1 + layers * 4 + 1)
    assert _count(first, "allreduce", [0, 1], 128 * 8 * 2) == m * layers + m
    # the 4 local experts of each layer (3 x 128 x 192 each) reduced in fp32 over the expert-data-parallel ranks
    # [0, 2], apart from the rest
    experts = layers * 4 * 3 * 128 * 192
    assert _count(first, "allreduce", [0, 2], 4 * experts) == 1
    assert _count(first, "allreduce", [0, 2], 4 * (first["parameters"] - experts)) == 1


def test_experts_split_over_tensor_parallel_ranks_step_as_planned(tmp_path):
    """The same world with expert TP 2: each rank's expert slices (F / 2) as planned, and the rows gathered over TP
    and the partial outputs reduce-scattered back (uneven all-to-alls over the TP pair) on the planner's TP axis."""
    result = subprocess.run([sys.executable, "tools/dry_run.py", *FLAGS, "--expert-tensor-parallel-size", "2",
                             "--jobs", "2", "--step", "--json", str(tmp_path / "dry.json")], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert_succeeded(result, tail=None)
    assert "traffic and memory as planned, memory within the device" in result.stdout
    first = json.loads((tmp_path / "dry.json").read_text())["ranks"]["0"]
    assert first["groups"]["ours"]["expert"] == [0, 2] and first["groups"]["ours"]["expert-data"] == [0]
