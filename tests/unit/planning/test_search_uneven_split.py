"""tools/plan.py --search with Megatron-LM's uneven split flags: every candidate keeps the split, so each ranked row
is the plan of that layout with the flags' stages (not the even split's), and a PP or schedule the split does not
fit is counted as breaking it; --pipeline-model-parallel-layout, which fixes PP, is refused by name."""
import json

from megatron_ds.core.pipeline_split import PipelineSplit
from megatron_ds.planning import plan_cli, search
from megatron_ds.planning.model import Layout
from megatron_ds.planning.performance import PerformanceAssumptions
from tests.support.planning_specs import cpu_cluster, small_model

FIRST_AND_LAST = PipelineSplit(first_stage_layers=1, last_stage_layers=1)   # 8 layers at PP 4: 1 + 3 + 3 + 1


def _layout_of(row, split):
    return Layout(row["tp"], row["pp"], row["dp"], row["micro_batch_size"], 16, row["sequence_parallel"],
                  row["recompute"], 1, ulysses=row["ulysses"], pipeline_schedule=row["pipeline_schedule"],
                  virtual_stages=row["virtual_stages"], split=split)


def test_every_ranked_row_is_its_layouts_plan_with_the_flags_split():
    model, cluster = small_model(layers=8), cpu_cluster(4)
    result = search.search_layouts(model, cluster, 16, top=1000, split=FIRST_AND_LAST)
    ranked = result["ranked"]
    assert result["split"] == "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1"
    assert {row["pp"] for row in ranked} == {4}   # PP 1 has no end stages, PP 2 no middle ones for 6 layers
    assert {row["pipeline_schedule"] for row in ranked} <= {"1f1b", "zbh1"}   # F 1 splits into no virtual stages
    assert all(search.evaluate(model, _layout_of(row, FIRST_AND_LAST), cluster, PerformanceAssumptions()) == row
               for row in ranked)
    assert result["infeasible_by_reason"]["uneven pipeline split"]["count"] > 0
    evenly = search.evaluate(model, _layout_of(ranked[0], PipelineSplit()), cluster, PerformanceAssumptions())
    assert evenly["peak_memory_gib"] < ranked[0]["peak_memory_gib"]   # 3 layers on the busiest stage, not 2


def test_the_planner_searches_with_the_flags_and_refuses_a_layout(capsys):
    flags = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--vocab-size", "256", "--global-batch-size", "16", "--world-size", "4", "--device", "a100-40gb",
             "--search", "--top", "1000"]
    assert plan_cli.main(flags + ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
                                  "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["search"]
    assert result["split"] and {row["pp"] for row in result["ranked"]} == {4}
    assert plan_cli.main(flags + ["--pipeline-model-parallel-layout", "Et|ttt|ttt|tL"]) == 2
    assert ("--search with --pipeline-model-parallel-layout Et|ttt|ttt|tL: the layout names each model stage, so it "
            "fixes PP") in capsys.readouterr().err
