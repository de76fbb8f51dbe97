"""megatron_ds.planning.search: the candidate layouts of a world, each judged feasible or by the first rule
it breaks (or its memory shortfall), and the feasible ones ranked by estimated iteration time."""
import collections
import dataclasses

import pytest
import torch

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning import search
from megatron_ds.planning.memory import GIB
from megatron_ds.planning.model import Cluster, Layout, ModelSpec
from megatron_ds.planning.performance import PerformanceAssumptions
from megatron_ds.planning.planner import make_plan
from tests.support.planning_specs import cpu_cluster, hand_case

ASSUMPTIONS = PerformanceAssumptions()


def three_layers_two_heads():
    """l 3 (PP 2 and 4 break it), a 2 (TP 4 breaks it), h 64, s 32, V 256, bf16."""
    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=2, params_dtype=torch.bfloat16)
    return ModelSpec(config, 256, 128, 32, 32, True)


def test_divisors():
    assert search.divisors(12) == [1, 2, 3, 4, 6, 12]
    assert search.divisors(7) == [1, 7]
    assert search.divisors(1) == [1]


def test_candidates_of_four_gpus_by_hand():
    """World 4, global batch 4. Without Ulysses, (tp, pp, dp) in (1,1,4) (1,2,2) (1,4,1) (2,1,2) (2,2,1)
    (4,1,1); micro batches with micro x dp <= 4: 1 for DP 4, 1-2 for DP 2, 1-4 for DP 1; SP off/on when TP > 1;
    3 recompute choices: 3 + 6 + 9 + 12 + 18 + 18 = 66. Ulysses 2 leaves 2 ranks: (1,1,2) (1,2,1) (2,1,1):
    6 + 9 + 18 = 33; Ulysses 4 leaves (1,1,1): 9. CP takes a divisor of what is left after Ulysses, TP and PP as
    Ulysses does of the world: without Ulysses CP 2 33 and CP 4 9 more, with Ulysses 2 CP 2 9 more. 159 in all,
    smaller Ulysses sizes first, and for each Ulysses, TP and PP smaller CP sizes first."""
    layouts = list(search.candidate_layouts(4, 4, zero_stage=1))
    assert len(layouts) == 159 == len(set(layouts))
    assert [layout.ulysses for layout in layouts] == [1] * 108 + [2] * 42 + [4] * 9
    assert collections.Counter((layout.ulysses, layout.context) for layout in layouts) == {
        (1, 1): 66, (1, 2): 33, (1, 4): 9, (2, 1): 33, (2, 2): 9, (4, 1): 9}
    assert [layout.context for layout in layouts[:18]] == [1] * 3 + [2] * 6 + [4] * 9    # TP 1 x PP 1: CP 1, 2, 4
    assert all(layout.world_size == 4 and layout.zero_stage == 1 for layout in layouts)
    assert not any(layout.sequence_parallel for layout in layouts if layout.tp == 1)
    assert max(layout.micro_batch_size * layout.dp for layout in layouts) == 4


def test_smaller_sequence_splits_move_their_ranks_to_dp():
    layout = Layout(2, 1, 1, 4, 8, ulysses=4)
    assert search.smaller_sequence_splits(layout) == [Layout(2, 1, 4, 4, 8), Layout(2, 1, 2, 4, 8, ulysses=2)]
    assert search.smaller_sequence_splits(Layout(2, 1, 1, 4, 8, ulysses=2, context=2)) == [
        Layout(2, 1, 4, 4, 8), Layout(2, 1, 2, 4, 8, context=2), Layout(2, 1, 2, 4, 8, ulysses=2)]
    assert search.smaller_sequence_splits(Layout(2, 1, 4, 4, 8)) == []


def test_micro_batch_1_is_always_a_candidate():
    """DP 8 with global batch 4: no micro batch fits, micro batch 1 is still tried (and then rejected)."""
    layouts = list(search.candidate_layouts(8, 4, zero_stage=1))
    assert {layout.micro_batch_size for layout in layouts if layout.dp == 8} == {1}


def test_infeasible_layout_reports_its_first_broken_rule():
    layout = Layout(4, 2, 1, 1, 8)           # heads 2 over TP 4, kv heads too, and 3 layers over PP 2
    assert search.evaluate(three_layers_two_heads(), layout, cpu_cluster(), ASSUMPTIONS) == (
        "heads not divisible by TP", "2 heads over TP 4", None)


def test_out_of_memory_shortfall_by_hand():
    """The hand case's stage 0 needs 14 B x 60608 states + 415744 activation bytes (2 micro-batches of 2 layers
    of s b h (10 + 24/2 + 4a/h/2) = 90624 with flash attention, plus the 4096-byte embedding mask of each, one
    layer's backward working set 32768 and the pipeline's 3 x 4096, test_memory.py) + 2 GiB overhead; a 2 GiB
    device is 848512 + 415744 = 1264256 bytes short. (Stage 1, 14 x 60736 + 2 x 90624
    + 4 s b h + the cross entropy's 114688 + 32768 = 1195392 bytes, needs less.)"""
    model, layout = hand_case()
    tiny = Cluster(dataclasses.replace(device_spec("cpu"), memory_gib=2.0), 8, 8)
    shortfall = 14 * 60608 + 2 * (2 * 90624 + 4096) + 32768 + 3 * 4096
    assert shortfall == 1264256
    assert search.evaluate(model, layout, tiny, ASSUMPTIONS) == (
        "out of memory", "needs 2.0 GiB of 2 (over by 0.0 GiB)", shortfall)


def test_feasible_row_agrees_with_the_layouts_plan():
    model, layout = hand_case()
    row = search.evaluate(model, layout, cpu_cluster(), ASSUMPTIONS)
    plan = make_plan(model, layout, cpu_cluster(), ASSUMPTIONS)
    # stage 0, as in test_out_of_memory_shortfall_by_hand: 14 B x 60608 states, 415744 activation bytes
    assert row["peak_memory_gib"] == plan["memory"]["peak_bytes"] / GIB == (14 * 60608 + 415744) / GIB + 2
    assert row["margin_gib"] == pytest.approx(64 - row["peak_memory_gib"])
    assert row["iteration_s"] == plan["performance"]["iteration_s"]
    assert (row["num_micro_batches"], row["bubble_fraction"]) == (4, 1 / 5)
    assert not row["tp_spans_nodes"]


def test_search_counts_every_candidate_once():
    """World 4, global batch 8, without Ulysses: 6 + 9 + 12 + 18 + 24 + 24 = 93 candidates. PP 2 or 4 breaks 3
    layers ((1,2,2): 9, (1,4,1): 12, (2,2,1): 24 = 45); TP 4 breaks 2 heads ((4,1,1): 24); (1,1,4) and (2,1,2)
    fit (micro batch 1-2 and 1-4). Ulysses 2 (tried only where the same layout with DP x 2 is not a fit):
    (1,1,2) at micro batch 4 (no DP 4 twin: 4 x 4 > 8) fits, 3; (1,2,1) breaks PP, 12; (2,1,1) at micro batch 8
    (2 x 3 choices) has 1 head per TP rank for 2 Ulysses ranks, 6. Ulysses 4, (1,1,1) at micro batch 8: 2 heads
    over 4, 3. Passed over: 6 + 18 at Ulysses 2, 6 + 3 at Ulysses 4. CP the same, but that it splits no heads:
    CP 2 (1,1,2) at micro batch 4 fits, 3; (1,2,1) breaks PP, 12; (2,1,1) at micro batch 8 fits, 6; CP 4 (1,1,1)
    at micro batch 8 fits, 3, and so does Ulysses 2 x CP 2, 3; passed over 33 at CP alone and 9 at Ulysses 2 x
    CP 2 (micro batch 1, 2 and 4)."""
    result = search.search_layouts(three_layers_two_heads(), cpu_cluster(4), 8, top=5)
    assert (result["world_size"], result["global_batch_size"]) == (4, 8)
    assert (result["candidates"], result["feasible"], result["sequence_split_skipped"]) == (
        93 + 24 + 27, 24 + 3 + 15, 33 + 33 + 9)
    reasons = result["infeasible_by_reason"]
    assert list(reasons) == ["layers not divisible by PP", "heads not divisible by TP",          # most common first
                             "heads of a TP rank not divisible by Ulysses SP"]
    assert [entry["count"] for entry in reasons.values()] == [45 + 12 + 12, 24, 6 + 3]
    assert reasons["layers not divisible by PP"]["examples"] == [
        "TP 1 PP 2 DP 2 mb 1 SP off recompute none: 3 layers over PP 2",
        "TP 1 PP 4 DP 1 mb 1 SP off recompute none: 3 layers over PP 4"]                     # one per detail
    assert reasons["heads not divisible by TP"]["examples"] == [
        "TP 4 PP 1 DP 1 mb 1 SP off recompute none: 2 heads over TP 4"]
    assert reasons["heads of a TP rank not divisible by Ulysses SP"]["examples"] == [
        "TP 2 Ulysses 2 PP 1 DP 1 mb 8 SP off recompute none: 2 heads over TP 2 = 1 per TP rank, over Ulysses SP 2",
        "TP 1 Ulysses 4 PP 1 DP 1 mb 8 SP off recompute none: 2 heads over TP 1 = 2 per TP rank, over Ulysses SP 4"]


def test_search_shows_the_top_rows_fastest_first():
    everything = search.search_layouts(three_layers_two_heads(), cpu_cluster(4), 8, top=1000)["ranked"]
    top = search.search_layouts(three_layers_two_heads(), cpu_cluster(4), 8, top=5)["ranked"]
    assert len(everything) == 42 and top == everything[:5]
    assert [row["iteration_s"] for row in everything] == sorted(row["iteration_s"] for row in everything)
    assert {(row["tp"], row["ulysses"], row["context"], row["pp"], row["dp"]) for row in everything} == {
        (1, 1, 1, 1, 4), (2, 1, 1, 1, 2), (1, 2, 1, 1, 2), (1, 1, 2, 1, 2), (2, 1, 2, 1, 1), (1, 1, 4, 1, 1),
        (1, 2, 2, 1, 1)}


def test_ranking_breaks_time_ties_by_lower_peak_memory(monkeypatch):
    rows = {1: {"iteration_s": 2.0, "peak_memory_gib": 1.0}, 2: {"iteration_s": 1.0, "peak_memory_gib": 9.0},
            4: {"iteration_s": 1.0, "peak_memory_gib": 3.0}}
    monkeypatch.setattr(search, "candidate_layouts", lambda *args: [Layout(1, 1, 1, mb, 4) for mb in rows])
    monkeypatch.setattr(search, "evaluate", lambda model, layout, *args: dict(rows[layout.micro_batch_size]))
    ranked = search.search_layouts(None, cpu_cluster(1), 4)["ranked"]
    assert [(row["iteration_s"], row["peak_memory_gib"]) for row in ranked] == [(1.0, 3.0), (1.0, 9.0), (2.0, 1.0)]


def test_examples_are_the_nearest_to_fitting_one_per_detail():
    items = [(3.0, ("A", "x")), (1.0, ("B", "y")), (2.0, ("C", "y")), (0.5, ("D", "z")), (0.7, ("E", "w"))]
    assert search._examples(items) == ["D: z", "E: w", "B: y"]      # C repeats B's detail; A is the farthest
