"""bench/long_context.py --compare without a run in turns: its flags and their defaults, the bad shapes it names,
the per-rank attention seconds it reads back from a side's output, its summary lines and the goal's verdict; and on
2 gloo ranks, each side's attention (the load-balanced ring, Ulysses around SDPA, the contiguous ring written in the
bench) against single-process causal attention, forward and backward, so that the sides compared do the same work."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import long_context
from bench.turns import Ratio
from tests.support.distributed import run_distributed


def test_the_comparison_s_defaults_are_two_ranks_hidden_256_and_16k():
    args = long_context.parse_arguments(["--compare"])
    assert (args.ranks, args.hidden_size, args.num_attention_heads, args.seq_length, args.dtype) == (
        2, 256, 8, 16384, "bf16")
    assert (args.warm_up, args.rounds, args.rotations_per_round) == (1, 5, 3)
    assert long_context.steps_of(args) == 16
    search = long_context.parse_arguments([])  # the memory search keeps its own defaults
    assert (search.ranks, search.hidden_size, search.compare) == (4, 128, False)


@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "1004", "--ranks", "4"], "--seq-length 1004 must divide by 2 x --ranks = 8"),
    (["--num-attention-heads", "6", "--hidden-size", "96", "--ranks", "4"],
     "--num-attention-heads 6 must divide by --ranks 4"),
    (["--hidden-size", "100"], "--hidden-size 100 must divide by --num-attention-heads 8"),
    (["--method", "pinned"], "--method pinned runs single-process sides"),
])
def test_bad_shapes_are_named(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        long_context.parse_arguments(["--compare", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_worker_command_carries_the_shapes_and_the_steps():
    args = long_context.parse_arguments(["--compare", "--seq-length", "64", "--rounds", "2",
                                         "--rotations-per-round", "2"])
    command = long_context._worker_command(args, "unbalanced", 29500)
    assert command[1:5] == ["--nproc_per_node", "2", "--master_port", "29500"]
    assert command[5] == "bench/long_context.py"
    worker = long_context.parse_arguments(command[6:])  # the side's processes parse the flags they are given
    assert (worker.attention_worker, worker.seq_length, worker.hidden_size, worker.steps, worker.dtype) == (
        "unbalanced", 64, 256, 5, "bf16")


def test_each_rank_s_attention_seconds_are_read_from_the_side_s_output():
    output = ("noise\n" + long_context.BUSY_LINE.format(rank=1, seconds="[0.5, 0.25]") + "\n[W] a warning\n"
              + long_context.BUSY_LINE.format(rank=0, seconds="[1.0, 2.0]") + "\n")
    assert long_context.parse_busy(output) == {0: [1.0, 2.0], 1: [0.5, 0.25]}
    assert long_context.parse_busy("nothing here") == {}
    assert long_context.rank_spread({0: [1.0, 3.0, 2.0], 1: [1.0, 1.0, 1.0]}) == (0, 1)


def test_the_summary_prints_rates_ranks_ratios_and_the_goal():
    args = long_context.parse_arguments(["--compare", "--seq-length", "1024", "--rounds", "2",
                                         "--rotations-per-round", "2"])
    seconds = {"ring": [9.0, 1.0, 1.0, 1.0, 1.0], "ulysses": [9.0, 1.0, 1.0, 1.0, 1.0],
               "unbalanced": [9.0, 1.5, 1.5, 1.5, 1.5]}
    busy = {"ring": {0: [5.0, 1.0, 1.0, 1.0, 1.0], 1: [5.0, 1.02, 1.02, 1.02, 1.02]},
            "ulysses": {0: [5.0, 0.9, 0.9, 0.9, 0.9], 1: [5.0, 0.9, 0.9, 0.9, 0.9]},
            "unbalanced": {0: [5.0, 0.5, 0.5, 0.5, 0.5], 1: [5.0, 1.5, 1.5, 1.5, 1.5]}}
    lines = "\n".join(long_context.summarize(args, seconds, busy))
    assert re.search(r"CP 2 ring, load-balanced \(p2p\) +1,024 +1\.000 +1\.020 \(rank 1\), 1\.000 \(rank 0\)", lines)
    assert "ring / ulysses tokens/s: 1.00x (rounds 1.00-1.00, 2 rounds of 2)" in lines
    assert "ring / unbalanced tokens/s: 1.50x (rounds 1.50-1.50, 2 rounds of 2)" in lines
    assert "unbalanced: slowest / fastest rank's attention time: 3.00x (rounds 3.00-3.00, 2 rounds of 2)" in lines
    assert lines.endswith("goal: ring >= 0.9x Ulysses' tokens/s: met; the ring's ranks within 10%: met")


@pytest.mark.parametrize("rounds, expected", [
    ([0.85, 0.86], "not met"), ([0.91, 0.99], "met in every round (unstable)"),
    ([0.70, 0.84], "not met in any round (unstable)"), ([0.85, 0.95], "undecided (unstable)")])
def test_the_goal_is_met_missed_or_undecided_by_the_rounds(rounds, expected):
    line = long_context.goal_line(Ratio(rounds, 3), Ratio([1.0, 1.01], 3), max_spread=0.05)
    assert line == f"goal: ring >= 0.9x Ulysses' tokens/s: {expected}; the ring's ranks within 10%: met"


def _side_matches_whole_attention(side):
    rank, size = dist.get_rank(), dist.get_world_size()
    wholes = long_context.whole_inputs(2, 4, 32, 8, torch.float64)
    parts = [long_context.rank_part(side, whole, rank, size) for whole in wholes]
    clock = long_context.BusyClock()
    out = long_context.side_attention(side, dist.group.WORLD, clock)(*parts)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    out.backward(grad_out)
    assert clock.take() > 0  # every side's compute is counted
    gathered = {}
    for name, tensor in (("out", out.detach()), ("grad_out", grad_out), *((f"grad{i}", p.grad) for i, p in
                                                                           enumerate(parts))):
        pieces = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(pieces, tensor.contiguous())
        gathered[name] = long_context.join_parts(side, pieces)
    reference = [whole.clone().requires_grad_() for whole in wholes]
    expected = F.scaled_dot_product_attention(*reference, is_causal=True)
    expected.backward(gathered["grad_out"])
    torch.testing.assert_close(gathered["out"], expected.detach(), rtol=1e-10, atol=1e-10)
    for index, tensor in enumerate(reference):
        torch.testing.assert_close(gathered[f"grad{index}"], tensor.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("side", long_context.SIDES)
def test_every_side_is_whole_causal_attention_forward_and_backward(side):
    run_distributed(_side_matches_whole_attention, 2, side, timeout=120)
