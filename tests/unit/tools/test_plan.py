"""tools/plan.py itself: flags -> model, layout and plan, the JSON and text output, exit statuses, the search
through the CLI, the reproduction configs in examples/ and --instantiate. The planning modules' numbers are
unit-tested, by hand, in tests/unit/planning/."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_ds.planning import plan_cli as cli
from megatron_ds.planning.planner import make_plan
from tests.support.launch import assert_succeeded
from tests.support.planning_specs import (
    HAND_CASE_FLAGS,
    TIME_CASE_FLAGS,
    ULYSSES_CASE_FLAGS,
    cpu_cluster,
    hand_case,
    time_case,
    ulysses_case,
)

REPO = Path(__file__).resolve().parents[3]


def plan_json(argv, capsys):
    status = cli.main(argv + ["--json"])
    return status, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- flags -> the plan

@pytest.mark.parametrize("flags,case", [(HAND_CASE_FLAGS, hand_case), (TIME_CASE_FLAGS, time_case),
                                        (ULYSSES_CASE_FLAGS, ulysses_case)],
                         ids=["hand_case", "time_case", "ulysses_case"])
def test_flags_resolve_to_the_unit_tests_cases_and_print_their_plan(flags, case, capsys):
    """The cases tests/unit/planning/ works out by hand, given as flags: same model, same layout, and the JSON
    plan is make_plan's (so the hand-computed memory, communication and time hold for the tool's output)."""
    model, layout = case()
    args = cli.validated_args(cli.build_plan_parser().parse_args(flags))
    assert cli.model_spec(args) == model and cli.layout_from_args(args) == layout
    status, result = plan_json(flags, capsys)
    assert status == 0
    assert result["plan"] == json.loads(json.dumps(make_plan(model, layout, cpu_cluster(layout.world_size))))
    assert result["layout_description"] == layout.describe()


def test_text_plan_has_every_section_and_groups_equal_stages(capsys):
    """The time case: 51200 x 64 + 32 x 64 embedding, 8 layers of 12h^2 + 13h = 49984, final norm 128."""
    status = cli.main(TIME_CASE_FLAGS)
    text = capsys.readouterr().out
    assert status == 0
    assert "total (distinct, vocab padded to 51200): 3,678,848" in text
    sections = ["Parameters", "Memory per device", "FLOPs per iteration",
                "Communication per device per iteration (bytes sent, ring algorithms)", "Estimated time",
                "Assumptions"]
    lines = text.splitlines()
    assert "Warnings" not in lines          # a layout nothing warns about has no such section
    assert [lines.index(section) for section in sections] == sorted(lines.index(section) for section in sections)
    middle = [line.split() for line in lines if line.strip().startswith("1-2 ")]
    assert middle and middle[0][:4] == ["1-2", "2", "99,968", "99,968"]      # stages 1 and 2: 2 layers only
    assert "bubble 42.9%" in text                                             # 3 / (4 + 3)


# ---------------------------------------------------------------- CLI, search, JSON

def test_tp_spanning_nodes_is_a_warning(capsys):
    status, result = plan_json(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "16",
                                "--seq-length", "32", "--tensor-model-parallel-size", "16", "--world-size", "16",
                                "--gpus-per-node", "8"], capsys)
    assert status == 0
    assert any("spans nodes" in warning for warning in result["plan"]["warnings"])
    assert result["plan"]["performance"]["links"]["tensor"] == 25e9


def test_search_ranks_feasible_layouts_and_explains_the_rest(capsys):
    status, result = plan_json(["--num-layers", "30", "--hidden-size", "4096", "--num-attention-heads", "16",
                                "--seq-length", "2048", "--vocab-size", "50257", "--bf16", "--global-batch-size", "64",
                                "--world-size", "32", "--device", "a100-40gb", "--search", "--top", "1000"], capsys)
    assert status == 0
    search = result["search"]
    ranked = search["ranked"]
    assert ranked and len(ranked) == search["feasible"]
    assert [row["iteration_s"] for row in ranked] == sorted(row["iteration_s"] for row in ranked)
    assert all(row["peak_memory_gib"] <= 40 and row["margin_gib"] >= 0 for row in ranked)
    assert all(32 % row["tp"] == 0 and 30 % row["pp"] == 0 and 16 % row["tp"] == 0 for row in ranked)
    assert any(row["tp_spans_nodes"] for row in ranked) and not ranked[0]["tp_spans_nodes"]
    reasons = search["infeasible_by_reason"]
    assert {"out of memory", "heads not divisible by TP", "layers not divisible by PP"} <= set(reasons)
    assert all("over by" in example for example in reasons["out of memory"]["examples"])
    assert search["candidates"] == search["feasible"] + sum(entry["count"] for entry in reasons.values())


def test_search_text_is_short(capsys):
    status = cli.main(["--num-layers", "30", "--hidden-size", "4096", "--num-attention-heads", "16", "--seq-length",
                       "2048", "--bf16", "--global-batch-size", "64", "--world-size", "32", "--device", "a100-40gb",
                       "--search"])
    text = capsys.readouterr().out
    assert status == 0 and len(text.splitlines()) < 60
    assert "Infeasible, by the first rule broken:" in text and "out of memory" in text


def test_invalid_layout_is_an_error_naming_the_flags(capsys):
    status = cli.main(["--num-layers", "5", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "32", "--pipeline-model-parallel-size", "2", "--world-size", "2"])
    assert status == 2
    assert "--num-layers 5 is not divisible by --pipeline-model-parallel-size 2" in capsys.readouterr().err


def test_ulysses_plan_text_and_training_s_refusals(capsys):
    """--ds-sequence-parallel-size: the layout line and the all-to-all volume per layer in the text; the layouts
    pretrain.py refuses are refused with its message (a TP rank's 2 heads over 4 Ulysses ranks)."""
    assert cli.main(ULYSSES_CASE_FLAGS) == 0
    text = capsys.readouterr().out
    assert "layout:  TP 2 x Ulysses SP 2 x PP 2 x DP 2" in text
    assert "Ulysses SP 2 (20 GB/s): 4 all-to-alls in forward (q, k, v, context)" in text
    flags = ULYSSES_CASE_FLAGS[:ULYSSES_CASE_FLAGS.index("--ds-sequence-parallel-size")] + [
        "--ds-sequence-parallel-size", "4", "--world-size", "16"]
    assert cli.main(flags) == 2
    assert ("--ds-sequence-parallel-size 4: the 2 attention heads of a TP rank (--num-attention-heads 4 / "
            "--tensor-model-parallel-size 2) do not split over SP 4") in capsys.readouterr().err


def test_search_chooses_ulysses_whatever_the_flag_says(capsys):
    """--search resolves the model at TP = Ulysses = PP = 1, so a --ds-sequence-parallel-size the model would
    refuse (its 4 heads over 8 Ulysses ranks) does not stop it."""
    flags = ULYSSES_CASE_FLAGS[:ULYSSES_CASE_FLAGS.index("--ds-sequence-parallel-size")] + [
        "--ds-sequence-parallel-size", "8", "--world-size", "16", "--search"]
    assert cli.validated_args(cli.build_plan_parser().parse_args(flags)).ds_sequence_parallel_size == 1
    status, result = plan_json(flags, capsys)
    assert status == 0 and result["search"]["ranked"]


def test_planner_resolves_recompute_and_sp_as_pretrain_does():
    args = cli.build_plan_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                                               "4", "--seq-length", "32", "--tensor-model-parallel-size", "2",
                                               "--sequence-parallel", "--recompute-activations", "--world-size", "2"])
    layout = cli.layout_from_args(cli.validated_args(args))
    assert layout.sequence_parallel and layout.recompute == "selective"


def test_json_entry_point():
    """tools/plan.py as users run it: one JSON object on stdout."""
    completed = subprocess.run(
        [sys.executable, "tools/plan.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
         "full", "--bf16", "--world-size", "4", "--device", "h100-80gb", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(completed, tail=None)
    result = json.loads(completed.stdout)
    assert result["plan"]["layout"]["recompute"] == "full" and result["plan"]["layout"]["sequence_parallel"]
    assert result["cluster"]["peak_tflops"] == 989.0
    assert result["plan"]["memory"]["fits"]


def test_instantiate_mismatch_exits_1(capsys, monkeypatch):
    import megatron_ds.planning.meta as meta
    real = meta.stage_parameters
    monkeypatch.setattr(meta, "stage_parameters", lambda *args, **kwargs: [
        type(stage)(stage.stage, stage.num_layers, stage.embedding, stage.layers + 1, stage.final_norm,
                    stage.output_head) for stage in real(*args, **kwargs)])
    status = cli.main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--pipeline-model-parallel-size", "2", "--world-size", "2", "--instantiate"])
    assert status == 1
    assert "MISMATCH" in capsys.readouterr().out


# ---------------------------------------------------------------- reproduction configs (examples/)

SCRIPTS = {"mtnlg_530b": 530e9, "gpt3_175b": 175e9, "gpt_1t": 1.0e12, "llama2_70b": 70e9, "llama31_405b": 405e9,
           "deepseek_v3_671b": 671e9}
PENDING_FLAGS = {"--rampup-batch-size"}   # used by the scripts, being added to pretrain.py by another issue


def script_args(name, plan):
    env = {key: value for key, value in os.environ.items() if key not in ("DATA_PATH", "PLAN", "HOSTFILE", "DRY_RUN")}
    env.update(PRINT_ARGS="1", **({"PLAN": "1"} if plan else {}))
    completed = subprocess.run(["bash", f"examples/pretrain_{name}.sh"], cwd=REPO, env=env, capture_output=True,
                               timeout=60)
    assert completed.returncode == 0, completed.stderr.decode()
    return completed.stdout.decode().split("\0")[:-1]


def gpt_total(layers, h, vocab, seq):
    return layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h


def llama_total(layers, h, heads, kv_heads, ffn, vocab):
    d = h // heads
    return layers * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * ffn + 2 * h) + 2 * vocab * h + h


def deepseek_v3_parts(h=7168, heads=128, q_rank=1536, kv_rank=512, qk=128, rope=64, v=128, dense_ffn=18432,
                      experts=256, expert_ffn=2048, topk=8, vocab=129280):
    """(attention, dense MLP, MoE MLP, its active part, one MTP module) of DeepSeek-V3, written out."""
    attention = (h * q_rank + q_rank + q_rank * heads * (qk + rope)       # query down, its norm, up
                 + h * (kv_rank + rope) + kv_rank + kv_rank * heads * (qk + v)   # key-value down, norm, up
                 + heads * v * h)                                          # output projection
    expert = 3 * h * expert_ffn
    moe, moe_active = h * experts + experts * expert + expert, h * experts + topk * expert + expert  # + shared
    mtp = 3 * h + 2 * h * h + attention + moe + 2 * h                     # enorm, hnorm, final norm; eh_proj; layer
    return attention, 3 * h * dense_ffn, moe, moe_active, mtp


def deepseek_v3_totals(layers=61, dense=3, h=7168, vocab=129280):
    """(total, active) as DeepSeek counts them: embedding and untied head, 3 dense and 58 MoE layers, no MTP."""
    attention, dense_mlp, moe, moe_active, _ = deepseek_v3_parts()
    common = 2 * vocab * h + h + layers * (attention + 2 * h) + dense * dense_mlp
    return common + (layers - dense) * moe, common + (layers - dense) * moe_active


EXACT_TOTALS = {
    "gpt3_175b": gpt_total(96, 12288, 51200, 2048),
    "mtnlg_530b": gpt_total(105, 20480, 51200, 2048),
    "gpt_1t": gpt_total(128, 25600, 51200, 2048),
    "llama2_70b": llama_total(80, 8192, 64, 8, 28672, 32000),
    "llama31_405b": llama_total(126, 16384, 128, 8, 53248, 129024),  # 128,256 padded for TP 8
    "deepseek_v3_671b": deepseek_v3_totals()[0],
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_reproduction_config_parameters_and_fit(name):
    args = cli.build_plan_parser().parse_args(script_args(name, plan=True))
    result, status = cli.run(args)
    assert status == 0
    total = result["plan"]["parameters"]["total"]
    assert total == EXACT_TOTALS[name]
    assert total == pytest.approx(SCRIPTS[name], rel=0.02)
    assert result["plan"]["memory"]["fits"]


def test_reproduction_totals_match_the_published_figures():
    assert EXACT_TOTALS["gpt3_175b"] == 174_615_846_912               # "174.6e9" with the vocab padded to 51200
    assert EXACT_TOTALS["llama2_70b"] == 68_976_648_192               # "68.98e9" with vocab 32000
    assert EXACT_TOTALS["llama31_405b"] == pytest.approx(405e9, rel=0.005)
    total, active = deepseek_v3_totals()
    assert (total, active) == (671_026_404_352, 37_552_282_624)        # the paper: 671B, 37B activated
    assert deepseek_v3_parts()[0] == 187_107_328                       # MLA's parameters per layer
    assert EXACT_TOTALS["mtnlg_530b"] == pytest.approx(530e9, rel=0.01)
    assert EXACT_TOTALS["gpt_1t"] == pytest.approx(1.0e12, rel=0.01)


def test_the_deepseek_v3_plan_counts_its_active_parameters_and_its_mtp_module_by_hand():
    """Beside the total: the parameters one token uses (router, its 8 experts and the shared one in each MoE layer)
    and the MTP module, which DeepSeek-V3's 671B leaves out (its 14B with the embedding and head copies the
    Hugging Face checkpoint stores; here they are shared)."""
    result, status = cli.run(cli.build_plan_parser().parse_args(script_args("deepseek_v3_671b", plan=True)))
    parameters = result["plan"]["parameters"]
    assert status == 0 and parameters["active"] == deepseek_v3_totals()[1]
    assert parameters["mtp"] == deepseek_v3_parts()[4] == 11_610_067_968
    assert [row["layers"] for row in parameters["per_stage"]] == [1 + 0, *[2 + 2] * 15]   # the layout's V


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_reproduction_scripts_use_real_flags_and_configs(name):
    """pretrain.py's own parser and validation accept each script's full command line (at its world size),
    apart from flags another issue is adding."""
    from megatron_ds.arguments import build_parser, parse_args
    argv = script_args(name, plan=False)
    known = build_parser()._option_string_actions
    unknown = {token for token in argv if token.startswith("--") and token not in known}
    assert unknown <= PENDING_FLAGS
    for flag in unknown:
        index = argv.index(flag)
        del argv[index:index + 4]                       # --rampup-batch-size START INCREMENT SAMPLES
    plan_argv = script_args(name, plan=True)
    world = int(plan_argv[plan_argv.index("--world-size") + 1])
    args = parse_args(argv, world_size=world)
    assert args.deepspeed_config.startswith("ds_configs/") and (REPO / args.deepspeed_config).is_file()


def test_instantiate_530b_every_stage(capsys):
    start = time.perf_counter()
    status, result = plan_json(script_args("mtnlg_530b", plan=True) + ["--instantiate"], capsys)
    assert status == 0
    check = result["instantiate"]
    assert check["ok"] and len(check["stages"]) == 35
    assert all(row["difference"] == 0 for row in check["stages"].values())
    assert check["stages"]["0"]["built"] == 2_060_874_240 and check["stages"]["34"]["built"] == 2_060_915_200
    assert time.perf_counter() - start < 90
