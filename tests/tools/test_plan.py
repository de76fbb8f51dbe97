"""tools/plan.py and megatron_ds.planning: exact parameter counts (against real models on CPU, DeepSpeed's
PipelineModule and meta-device builds), memory, FLOPs and bubble against hand-computed values, the search,
the JSON output, and the reproduction configs in examples/."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import GPTModel
from megatron_ds.core.models.gpt import model_flops_per_iteration as training_model_flops
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.planning import cli
from megatron_ds.planning.flops import hardware_flops_per_iteration, model_flops_per_iteration
from megatron_ds.planning.memory import (GIB, RUNTIME_OVERHEAD_BYTES, activation_bytes_per_layer,
                                         in_flight_micro_batches)
from megatron_ds.planning.meta import check_against_formula
from megatron_ds.planning.model import Layout, ModelSpec
from megatron_ds.planning.parameters import stage_parameters, total_parameters
from megatron_ds.planning.performance import bubble_fraction
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]
FAMILIES = {
    "gpt2": dict(),
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, bias=False, position_embedding_type="rope",
                  num_query_groups=4, ffn_hidden_size=96),
}
FAMILY_FLAGS = {
    "gpt2": [],
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings", "--disable-bias-linear",
              "--num-key-value-heads", "4", "--ffn-hidden-size", "96"],
}


def small_model(family="gpt2", tied=True, layers=4, vocab_size=300, divisible_by=8):
    config = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=8, **FAMILIES[family])
    return ModelSpec(config, vocab_size=vocab_size, make_vocab_size_divisible_by=divisible_by,
                     max_position_embeddings=16, seq_length=16, tied_embeddings=tied)


def count_parameters(module):
    return sum(param.numel() for param in module.parameters())


def plan_json(argv, capsys):
    status = cli.main(argv + ["--json"])
    return status, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- parameter counts against real models

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameter_formula_matches_gpt_model_built_on_cpu(family, tied, tp):
    """PP = 1: GPTModel (what training builds) on CPU for one TP rank; real tensors, real initialization."""
    model = small_model(family, tied)
    for rank in (0, tp - 1):
        with parallel_state.simulated_model_parallel(tp, rank, 1, 0):
            built = GPTModel(model.config, model.padded_vocab_size(tp), model.max_position_embeddings, tied)
        assert count_parameters(built) == stage_parameters(model, tp, 1)[0].total
    if tp == 1:
        assert count_parameters(built) == total_parameters(model, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp,layers", [(1, 2, 4), (2, 2, 4), (1, 4, 4), (4, 2, 2), (2, 3, 6)])
def test_parameter_formula_matches_meta_built_stages(family, tied, tp, pp, layers):
    model = small_model(family, tied, layers=layers)
    checks = check_against_formula(model, tp, pp)
    assert sorted(checks) == list(range(pp))
    assert all(row["difference"] == 0 for row in checks.values()), checks


def test_whole_model_total_counts_tied_weights_once():
    """Summing every stage's distinct parameters counts the last stage's tied copy twice; the total once."""
    for tied in (True, False):
        model = small_model("gpt2", tied, vocab_size=256, divisible_by=128)
        per_stage = sum(stage.total for stage in stage_parameters(model, 1, 2))
        copy = 256 * 32 + 16 * 32 if tied else 0           # word + (unused) position embeddings on the last stage
        assert per_stage == total_parameters(model) + copy


def _check_pipeline_module_counts(family, tied, tp, pp):
    import torch.distributed as dist
    from megatron_ds.arguments import parse_args, transformer_config_from_args
    from megatron_ds.glue.runtime import init_distributed
    from megatron_ds.training import build_model

    os.environ["LOCAL_RANK"] = str(dist.get_rank())   # DeepSpeed's PipelineModule reads it (a launcher sets it)
    init_distributed("gloo")
    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--seq-length", "16",
             "--train-iters", "1", "--mock-data", "--vocab-size", "300", "--make-vocab-size-divisible-by", "8",
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)] + FAMILY_FLAGS[family]
    flags += [] if tied else ["--untie-embeddings-and-output-weights"]
    args = parse_args(flags, world_size=dist.get_world_size())
    parallel_state.initialize_model_parallel(tp, pp)
    built = build_model(args, transformer_config_from_args(args))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    expected = stage_parameters(small_model(family, tied), tp, pp)[stage].total
    assert count_parameters(built) == expected, (stage, count_parameters(built), expected)


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("llama", False)])
@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1)])
def test_parameter_formula_matches_deepspeed_pipeline_module(family, tied, tp, pp):
    """The training code's model (DeepSpeed's PipelineModule for PP > 1) on real gloo ranks."""
    run_distributed(_check_pipeline_module_counts, tp * pp, family, tied, tp, pp, timeout=120)


# ---------------------------------------------------------------- memory, FLOPs, bubble by hand

def hand_case():
    """GPT-2 shape: l 4, h 64, a 4, s 32, V 256 (no padding at TP 2), bf16, tied; TP 2 x PP 2 x DP 2,
    micro batch 2, global batch 16 -> 4 micro-batches, ZeRO-1."""
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16)
    model = ModelSpec(config, vocab_size=256, make_vocab_size_divisible_by=128, max_position_embeddings=32,
                      seq_length=32, tied_embeddings=True)
    return model, Layout(tp=2, pp=2, dp=2, micro_batch_size=2, global_batch_size=16)


def test_parameters_by_hand():
    model, layout = hand_case()
    # per TP rank and layer: 12h^2 / 2 weights + 7h / 2 sharded biases + 2h row biases + 2 x 2h LayerNorm
    layer = 12 * 64 ** 2 // 2 + 7 * 64 // 2 + 2 * 64 + 4 * 64
    assert layer == 25184
    first, last = stage_parameters(model, layout.tp, layout.pp)
    assert first.total == 128 * 64 + 32 * 64 + 2 * layer == 60608
    assert last.total == 2 * layer + 2 * 64 + (128 * 64 + 32 * 64) == 60736      # final norm + tied copy
    assert total_parameters(model, 2) == 256 * 64 + 32 * 64 + 4 * (12 * 64 ** 2 + 13 * 64) + 2 * 64


def test_memory_by_hand(capsys):
    model, layout = hand_case()
    assert [in_flight_micro_batches(layout, stage) for stage in (0, 1)] == [2, 1]
    sbh = 32 * 2 * 64
    per_layer = sbh * (10 + 24 / 2 + 5 * 4 * 32 / (64 * 2))                       # TP, no SP, no recompute
    assert activation_bytes_per_layer(model, layout) == per_layer == 110592
    status, result = plan_json(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                                "--seq-length", "32", "--vocab-size", "256", "--bf16", "--tensor-model-parallel-size",
                                "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                "--global-batch-size", "16", "--world-size", "8", "--device", "cpu"], capsys)
    assert status == 0
    first, last = result["plan"]["memory"]["per_stage"]
    assert (first["weights"], first["gradients"], first["grad_accumulation"], first["optimizer"]) == \
           (2 * 60608, 2 * 60608, 4 * 60608, 12 / 2 * 60608)
    assert first["activations"] == 2 * 2 * per_layer + 2 * sbh                    # 2 in flight; embedding mask
    assert last["activations"] == 2 * per_layer + 4 * sbh + 4 * 32 * 2 * 256 / 2  # 1 in flight; norm/head, softmax
    assert first["total"] == 14 * 60608 + first["activations"] + RUNTIME_OVERHEAD_BYTES
    assert result["plan"]["memory"]["peak_stage"] == 0
    assert result["plan"]["memory"]["margin_bytes"] == 64 * GIB - first["total"]


def test_activation_formulas_are_the_design_table():
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8, params_dtype=torch.bfloat16)
    model = ModelSpec(config, 1000, 128, 512, 512, True)
    s, b, h, a, t = 512, 4, 256, 8, 4

    def bytes_for(tp, sp, recompute):
        return activation_bytes_per_layer(model, Layout(tp, 1, 1, b, b, sp, recompute))

    assert bytes_for(1, False, None) == s * b * h * (34 + 5 * a * s / h)
    assert bytes_for(t, False, None) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert bytes_for(t, True, None) == s * b * h / t * (34 + 5 * a * s / h)
    assert bytes_for(t, True, "selective") == 34 * s * b * h / t
    assert bytes_for(t, False, "full") == 2 * s * b * h


def test_full_recompute_methods_by_hand():
    """Megatron's "uniform" (chunks of N layers, one input saved per chunk) and "block" (only the first N
    layers of each stage recomputed)."""
    from megatron_ds.planning.memory import stage_activation_bytes
    model, _ = hand_case()
    sbh, whole_layer = 32 * 2 * 64, 110592
    uniform = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="uniform", recompute_num_layers=2)
    block = Layout(2, 2, 1, 2, 8, recompute="full", recompute_method="block", recompute_num_layers=1)
    last_stage_extra = 4 * sbh + 4 * 32 * 2 * 256 / 2
    assert stage_activation_bytes(model, uniform, 1, 2) == 2 * sbh + 2 * whole_layer + last_stage_extra
    assert stage_activation_bytes(model, block, 0, 2) == 2 * (2 * sbh + whole_layer) + whole_layer + 2 * sbh
    base = model_flops_per_iteration(model, uniform)
    every_layer = hardware_flops_per_iteration(model, uniform) - base
    assert hardware_flops_per_iteration(model, block) - base == pytest.approx(every_layer / 2)   # 1 of 2 per stage


def test_flops_by_hand():
    model, layout = hand_case()
    B, s, l, h, V = 16, 32, 4, 64, 256

    def flops(recompute):
        return hardware_flops_per_iteration(model, Layout(2, 2, 2, 2, 16, recompute=recompute))

    expected_model = 72 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert model_flops_per_iteration(model, layout) == pytest.approx(expected_model, rel=1e-12)
    assert expected_model == pytest.approx(704_643_072)
    assert model_flops_per_iteration(model, layout) == training_model_flops(model.config, 256, B, s)
    assert flops(None) == pytest.approx(expected_model, rel=1e-12)
    assert flops("selective") == pytest.approx(72 * B * s * l * h ** 2 * (1 + s / (3 * h) + V / (12 * l * h)))
    assert flops("full") == pytest.approx(96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h)))


def test_flops_of_a_llama_shape_match_the_training_code():
    model = small_model("llama", tied=False)
    layout = Layout(2, 2, 1, 1, 8)
    assert model_flops_per_iteration(model, layout) == training_model_flops(model.config, model.padded_vocab_size(2),
                                                                            8, 16)


def test_bubble_fraction_and_time_structure(capsys):
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(35, 240) == pytest.approx(34 / 274)
    status, result = plan_json(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                                "--seq-length", "32", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
                                "--global-batch-size", "8", "--world-size", "8", "--device", "cpu"], capsys)
    performance = result["plan"]["performance"]
    assert performance["bubble_fraction"] == pytest.approx(3 / (4 + 3))          # DP 2 -> 4 micro-batches
    parts = performance["breakdown_s"]
    assert parts["pipeline"] == pytest.approx(7 * performance["slowest_stage"]["total"])
    assert performance["iteration_s"] == pytest.approx(parts["pipeline"] + parts["data_parallel"] +
                                                       parts["tied_embedding"] + parts["optimizer_step"])
    assert performance["mfu"] == pytest.approx(result["plan"]["flops"]["model_per_iteration"] /
                                               performance["iteration_s"] / 8 / 2e12)


def test_communication_by_hand(capsys):
    status, result = plan_json(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                                "--seq-length", "32", "--vocab-size", "256", "--bf16", "--tensor-model-parallel-size",
                                "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                "--global-batch-size", "16", "--world-size", "8", "--device", "cpu"], capsys)
    comm = result["plan"]["communication"]
    payload = 32 * 2 * 64 * 2
    tp = comm["tensor_parallel"]["per_layer_per_micro_batch"]
    assert (tp["forward"], tp["backward"], tp["recompute"]) == (2 * payload, 2 * payload, 0)   # 2 x 2(t-1)/t
    assert comm["tensor_parallel"]["per_iteration_per_device"] == 4 * payload * 2 * 4           # 2 layers, m 4
    assert comm["pipeline"]["per_iteration_per_device"] == 2 * payload * 4
    dp = comm["data_parallel"]["per_iteration_per_device"]
    assert dp["gradient_all_reduce"] == 60736 * 4 * 2 * (2 - 1) / 2       # fp32 (BF16_Optimizer) all-reduce
    assert dp["weight_all_gather"] == 60736 * 2 * (2 - 1) / 2


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


def test_recompute_and_sequence_parallel_flags_are_added_only_when_missing():
    import argparse
    bare = argparse.ArgumentParser()
    cli._add_recompute_and_sp_flags(bare, bare)
    args = bare.parse_args(["--sequence-parallel", "--recompute-activations"])
    assert args.sequence_parallel and cli.recompute_choice(args) == "selective"
    cli._add_recompute_and_sp_flags(bare, bare)          # already there: nothing added, no conflict
    parser = cli.build_plan_parser()
    assert list(parser._option_string_actions).count("--sequence-parallel") == 1


def test_json_entry_point():
    """tools/plan.py as users run it: one JSON object on stdout."""
    completed = subprocess.run(
        [sys.executable, "tools/plan.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity",
         "full", "--bf16", "--world-size", "4", "--device", "h100-80gb", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    assert result["plan"]["layout"]["recompute"] == "full" and result["plan"]["layout"]["sequence_parallel"]
    assert result["cluster"]["peak_tflops"] == 989.0
    assert result["plan"]["memory"]["fits"]


def test_instantiate_mismatch_exits_1(capsys, monkeypatch):
    import megatron_ds.planning.meta as meta
    real = meta.stage_parameters
    monkeypatch.setattr(meta, "stage_parameters", lambda *args: [
        type(stage)(stage.stage, stage.num_layers, stage.embedding, stage.layers + 1, stage.final_norm,
                    stage.output_head) for stage in real(*args)])
    status = cli.main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--pipeline-model-parallel-size", "2", "--world-size", "2", "--instantiate"])
    assert status == 1
    assert "MISMATCH" in capsys.readouterr().out


# ---------------------------------------------------------------- reproduction configs (examples/)

SCRIPTS = {"mtnlg_530b": 530e9, "gpt3_175b": 175e9, "gpt_1t": 1.0e12, "llama2_70b": 70e9}
PENDING_FLAGS = {"--rampup-batch-size"}   # used by the scripts, being added to pretrain.py by another issue


def script_args(name, plan):
    env = {key: value for key, value in os.environ.items() if key not in ("DATA_PATH", "PLAN", "HOSTFILE")}
    env.update(DRY_RUN="1", **({"PLAN": "1"} if plan else {}))
    completed = subprocess.run(["bash", f"examples/pretrain_{name}.sh"], cwd=REPO, env=env, capture_output=True,
                               timeout=60)
    assert completed.returncode == 0, completed.stderr.decode()
    return completed.stdout.decode().split("\0")[:-1]


def gpt_total(layers, h, vocab, seq):
    return layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h


def llama_total(layers, h, heads, kv_heads, ffn, vocab):
    d = h // heads
    return layers * (h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * ffn + 2 * h) + 2 * vocab * h + h


EXACT_TOTALS = {
    "gpt3_175b": gpt_total(96, 12288, 51200, 2048),
    "mtnlg_530b": gpt_total(105, 20480, 51200, 2048),
    "gpt_1t": gpt_total(128, 25600, 51200, 2048),
    "llama2_70b": llama_total(80, 8192, 64, 8, 28672, 32000),
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
    assert EXACT_TOTALS["mtnlg_530b"] == pytest.approx(530e9, rel=0.01)
    assert EXACT_TOTALS["gpt_1t"] == pytest.approx(1.0e12, rel=0.01)


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
