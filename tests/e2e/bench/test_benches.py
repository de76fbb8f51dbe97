"""The training-throughput benchmark runs end to end on a tiny model and prints every figure it promises
(the figures themselves are measured, never asserted)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import assert_succeeded

REPO = Path(__file__).resolve().parents[3]


def test_train_throughput_prints_rounds_ratios_profile_and_layouts(tmp_path):
    """LLaMA-style with attention dropout against the plain loop and the HF transformers loop: one row per
    run, the same parameter count in all three, and pretrain.py's tokens/s over each loop's as a positive
    figure; with the profile table, pretrain.py at TP 2, without dropout and in FP8 (rowwise), each against
    pretrain.py at TP 1 in bf16 with it."""
    command = [sys.executable, "bench/train_throughput.py", "--family", "llama", "--baseline", "hf",
               "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-key-value-heads", "2",
               "--seq-length", "32", "--vocab-size", "256", "--attention-dropout", "0.1", "--rounds", "1",
               "--rotations-per-round", "2", "--gemm-size", "256", "--profile", "--profile-dir", str(tmp_path),
               "--layouts", "1x1", "2x1", "--fp8-recipes", "rowwise"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=2000)
    out = result.stdout
    for expected in ("bf16 GEMM (n 256)", "then 1 round of 2", "LLaMA-style model", "4 heads / 2 kv",
                     "dropout hidden 0 / attention 0.1", "pretrain.py (DeepSpeed, TP=PP=1)", "plain PyTorch loop",
                     "HF transformers loop (LlamaForCausalLM)", "MFU vs GEMM", "profile of iterations 4-5", "aten::mm",
                     "pretrain.py TP=2 PP=1 (2 ranks, 1 micro-batches/iter)"):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    assert "parameter counts differ" not in out, out
    ratios = dict(re.findall(r"pretrain\.py / (plain loop|HF loop) tokens/s: ([0-9.]+)x \(rounds [0-9.-]+, 1 round "
                             r"of 2\)", out))
    assert sorted(ratios) == ["HF loop", "plain loop"] and all(float(r) > 0 for r in ratios.values()), out
    tensor_parallel = re.search(r"pretrain\.py TP=2 PP=1 / TP=1 PP=1 tokens/s: ([0-9.]+)x \(rounds", out)
    dropout = re.search(r"pretrain\.py with dropout / without tokens/s: ([0-9.]+)x \(rounds [0-9.]+-[0-9.]+, 1 round "
                        r"of 2\): dropout costs -?[0-9.]+%", out)
    assert tensor_parallel and float(tensor_parallel[1]) > 0 and dropout and float(dropout[1]) > 0, out
    fp8 = re.search(r"pretrain\.py FP8 rowwise / bf16 tokens/s: ([0-9.]+)x \(rounds [0-9.]+-[0-9.]+, 1 round of 2\)",
                    out)
    assert "pretrain.py FP8 rowwise (e4m3)" in out and fp8 and float(fp8[1]) > 0, out
    assert (tmp_path / "profile_rank0_iterations4-5.json").is_file()


def test_train_throughput_without_a_loop_needs_another_side_to_compare(capsys):
    """--baseline none runs pretrain.py against its other --layouts and --fp8-recipes only: with neither it is
    refused (the FP8 sides themselves run in the test above)."""
    from bench.train_throughput import parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--baseline", "none"])
    assert exit_.value.code == 2
    assert "--baseline none leaves pretrain.py nothing to be compared with" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--method pinned needs a core per side")
def test_train_throughput_pinned_runs_pretrain_py_and_the_hf_loop_a_core_each():
    command = [sys.executable, "bench/train_throughput.py", "--family", "llama", "--baseline", "hf", "--method",
               "pinned", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--num-key-value-heads", "2", "--seq-length", "32", "--vocab-size", "256", "--rounds", "1",
               "--rotations-per-round", "2"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert_succeeded(result, tail=2000)
    out = result.stdout
    assert "no GEMM rate (it would need a core of its own); every side at the same time, each on a core of its own " \
           "with one thread, the cores swapped every rotation (--method pinned)" in out, out
    assert "plain PyTorch loop" not in out and re.search(r"pretrain\.py / HF loop tokens/s: [0-9.]+x \(rounds", out)
    refused = subprocess.run(command + ["--layouts", "1x1", "2x1"], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "--method pinned runs two sides, a core each" in refused.stderr


def test_method_spread_reads_each_runs_ratio_and_sums_up_each_method():
    from bench.method_spread import compared_ratio, summary
    output = ("  pretrain.py / plain loop tokens/s: 1.50x (rounds 1.45-1.52, 5 rounds of 8)\n"
              "  pretrain.py / HF loop tokens/s: unstable: rounds 1.02-1.31 lie 24.8% apart (> 5%); about 40 rounds "
              "needed\n")
    assert compared_ratio(output, ["--baseline", "hf"]) == (None, 1.02, 1.31)
    assert compared_ratio(output, []) == (1.5, 1.45, 1.52)
    assert summary("turns", [(1.5, 1.45, 1.52), (None, 1.4, 1.6), (1.56, 1.5, 1.58)]) == (
        "turns: 1.50x (1.45-1.52), unstable (1.40-1.60), 1.56x (1.50-1.58); medians 0.060 apart; widest range of "
        "rounds within a run 0.200 (3 runs)")


def test_ops_bench_times_an_op_s_backends_in_turns_and_prints_each_one_s_ratio_to_the_reference():
    command = [sys.executable, "bench/ops.py", "--size", "tiny", "--ops", "bias_dropout_add", "--backends",
               "reference", "compile", "--rounds", "2", "--rotations-per-round", "2", "--threads", "1"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert_succeeded(result, tail=2000)
    out = result.stdout
    assert ("an op's backends in turns, iteration by iteration, glibc malloc keeping freed memory: 3 warm-up "
            "rotations, then 2 rounds of 2") in out, out
    assert re.search(r"^bias_dropout_add +reference +[0-9.]+ +[0-9.]+ +[0-9.]+ +0\.00 +1\.00$", out, re.M), out
    compiled = re.search(r"^bias_dropout_add +compile .* ([0-9.]+x \(rounds [0-9.]+-[0-9.]+, 2 rounds of 2\)|"
                         r"unstable: rounds .*)$", out, re.M)
    assert compiled, out


def test_moe_bench_puts_the_dropless_layer_beside_dense_and_deepspeed_moe():
    """Four launches in turns: dense, DeepSpeed-MoE (here its dropless mode), the dropless layer in the dense model's
    shape and in DeepSpeed-MoE's; each side's rates, the dropless sides' loads, the three ratios and the profiled
    all-to-all share."""
    command = [sys.executable, "bench/moe.py", "--dropless", "--ranks", "2", "--experts", "4", "--num-layers", "2",
               "--hidden-size", "32", "--ffn-hidden-size", "64", "--seq-length", "32", "--vocab-size", "256",
               "--rounds", "1", "--rotations-per-round", "2", "--disable-moe-token-dropping"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=2000)
    rate = r": [0-9,]+ tokens/s, [0-9.]+ TFLOP/s per rank"
    experts = r"4 experts of FFN 32, top-2, every 2nd layer"
    for side in (r"dense  \(FFN 64\)" + rate,
                 rf"MoE    \({experts}, EP 2; dense layers FFN 32; no token dropped\){rate}",
                 rf"dropless MoE \({experts}, grouped GEMMs, EP 2\){rate}, load max/mean [0-9.]+",
                 rf"dropless MoE in DeepSpeed-MoE's model \(dense layers FFN 32\){rate}, load max/mean [0-9.]+"):
        assert re.search(rf"^{side}$", result.stdout, re.M), f"{side!r} missing from:\n{result.stdout}"
    ratio = r"tokens/s: [0-9.]+x \(rounds [0-9.]+-[0-9.]+, 1 round of 2\)"
    for pair in ("MoE / dense", "dropless / dense", r"dropless / DeepSpeed-MoE \(the same model\)"):
        assert re.search(rf"^{pair} {ratio}", result.stdout, re.M), f"{pair!r} missing from:\n{result.stdout}"
    share = float(result.stdout.split("all-to-all share of the MoE's rank 0 time: ")[1].split("%")[0])
    assert share > 0  # the profiler saw the all-to-alls


def test_long_context_bench_finds_the_longest_sequence_per_sequence_parallel_size():
    """A tiny search (one length each) with a budget that fits: a row per SP size with the length, the peak
    memory per rank and the rate; a budget below the Python runtime fits nothing."""
    command = [sys.executable, "bench/long_context.py", "--ranks", "2", "--sp-sizes", "1", "2", "--start-seq", "128",
               "--max-seq", "128", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
               "--vocab-size", "256"]
    result = subprocess.run(command + ["--budget-gib", "64"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=2000)
    rows = {int(sp): (int(length), float(peak), float(rate)) for sp, length, peak, rate in
            re.findall(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE)}
    assert sorted(rows) == [1, 2] and all(length == 128 and 0 < peak < 64 and rate > 0
                                          for length, peak, rate in rows.values()), result.stdout
    tight = subprocess.run(command + ["--sp-sizes", "1", "--budget-gib", "0.01"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(tight, tail=2000)
    assert "none fits" in tight.stdout, tight.stdout[-2000:]


def test_reshard_memory_bench_prints_the_checkpoint_the_share_and_the_load_s_extra_memory(tmp_path):
    """Saved at TP 1 x PP 2 on 2 ranks, resumed at TP 2 x PP 1 and started fresh there: the checkpoint's size,
    a rank's share, the peaks with and without the load and the load's extra memory print, all positive."""
    command = [sys.executable, "bench/reshard_memory.py", "--num-layers", "2", "--hidden-size", "256",
               "--num-attention-heads", "4", "--vocab-size", "4096", "--ranks", "2", "--saved", "1x2",
               "--targets", "2x1", "--folder", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=2000)
    out = result.stdout
    number = r"([0-9][0-9,.]*)"
    patterns = {"checkpoint": rf"checkpoint on disk: {number} GiB \({number} bytes\)",
                "share": rf"target TP 2 x PP 1 x DP 1:\n  a rank's share: {number} parameters x 16 bytes = "
                         rf"{number} GiB",
                "peaks": rf"fresh start {number} GiB, with the load {number} GiB \({number} GiB right before it\); "
                         rf"load {number} s",
                "extra": rf"the load's extra memory: {number} GiB = {number} x the checkpoint, {number} x the rank's "
                         rf"share"}
    for name, pattern in patterns.items():
        found = re.search(pattern, out)
        assert found and all(float(value.replace(",", "")) > 0 for value in found.groups()), f"{name}:\n{out}"


def test_pipeline_schedules_bench_prints_every_schedule_with_the_planners_bubble():
    """One round at m = 4, the schedules' launches in turns (bench/turns.py): every schedule runs (step time, the
    ratio to 1F1B, both stages' idle shares and the busiest stage's, the measured bubble) beside the planner's
    bubble."""
    command = [sys.executable, "bench/pipeline_schedules.py", "--micro-batches", "4", "--rounds", "1",
               "--rotations-per-round", "2", "--hidden-size", "32", "--seq-length", "16", "--num-layers", "4"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=2000)
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.strip().startswith("4 ")}
    assert sorted(rows) == ["1f1b", "dualpipev", "interleaved", "zbh1"], result.stdout
    shares = r"\s+[0-9.]+%\s+[0-9.]+%\s+[0-9.]+%\s+"   # idle stage 0, idle stage 1, measured bubble
    assert re.search(r"1\.00x \(rounds 1\.00-1\.00, 1 round of 2\)" + shares + r"20\.0%", rows["1f1b"]), rows["1f1b"]
    row = r"[0-9.]+x \(rounds [0-9.]+-[0-9.]+, 1 round of 2\)" + shares
    for schedule, planned in (("zbh1", "7.7%"), ("dualpipev", "4.0%"), ("interleaved", "11.1%")):
        assert re.search(row + re.escape(planned), rows[schedule]), rows[schedule]


@pytest.mark.parametrize("script", ["bench/gpu.sh", "bench/gpu_wheels.sh", "bench/gpu_rehearsal.sh"])
def test_the_gpu_scripts_are_valid_bash(script):
    """bench/gpu.sh runs only where a GPU is lent (scripts/test.sh rehearses it on this CPU after the suite, through
    bench/gpu_rehearsal.sh); here their syntax is checked."""
    result = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert_succeeded(result, tail=None)


def test_memory_vs_plan_reads_the_lines_pretrain_prints():
    """bench/memory_vs_plan.py reads Megatron's memory lines as observability/metrics.py writes them: the planner's peak
    and, on CUDA, the allocator's maximum, and their ratio; a CUDA run without the measured line fails."""
    from bench.memory_vs_plan import compare
    from megatron_ds.observability.metrics import MIB, measured_memory_text, theoretical_memory_line
    from megatron_ds.planning.memory import StageMemory
    predicted = StageMemory(stage=0, parameters=10, in_flight_micro_batches=1, weights=100 * MIB, gradients=100 * MIB,
                            grad_accumulation=200 * MIB, optimizer=600 * MIB, activations=500 * MIB,
                            overhead=2048 * MIB)
    theoretical = theoretical_memory_line(predicted)
    assert theoretical == ("Theoretical memory footprints: weight and optimizer=1000.00 MB, activation=500.00 MB, "
                           "total=1500.00 MB")
    measured = "[Rank 0] " + measured_memory_text(5, 900 * MIB, 1650 * MIB, 1800 * MIB, 2000 * MIB)
    lines, status = compare(f"noise\n{theoretical}\n iteration 5/20 |\n{measured}\n", expect_measured=True)
    assert status == 0 and lines[-1] == "memory max allocated / predicted: 1.100", lines
    assert "max allocated 1650 MiB, max reserved 2000 MiB" in lines[1]
    assert compare(theoretical, expect_measured=True)[1] == 1
    assert compare(theoretical, expect_measured=False)[1] == 0
    assert compare(measured, expect_measured=False)[1] == 1  # no prediction: the run did not get that far
    assert compare(f"{measured}\n{theoretical}", expect_measured=True)[1] == 1  # another rank's, before it
