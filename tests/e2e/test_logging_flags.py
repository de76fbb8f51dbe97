"""Megatron's logging flags in real launches: the TensorBoard scalars each --log-* flag names (read back with
TensorBoard's EventAccumulator) with values checked against the saved checkpoint, the iteration line's
added fields, the timers per --timing-log-level, the same scalars in an offline Weights & Biases run, and
--exit-duration-in-mins stopping a long run early, with a checkpoint."""
import importlib.util
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import TINY, full_state, layout_flags
from tests.support.launch import assert_succeeded, launch, losses

LOG_FLAGS = ["--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
             "--log-optimizer-states-to-tensorboard", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
             "--log-params-norm", "--log-num-zeros-in-grad"]
PIPELINE_TIMERS = ["forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv",
                   "forward-send", "backward-recv", "backward-send", "embedding-grads-all-reduce", "grads-all-reduce",
                   "optimizer"]
OPTIMIZER_SCALARS = [f"optimizer/{kind}_{norm}" for kind in ("variance", "variance_sqrt", "momentum", "weight")
                     for norm in ("l2", "l1", "abs_max")]
ADDED_FIELDS = re.compile(r" grad norm: [0-9.]+ \| num zeros: (\d+)\.0 \| params norm: ([0-9.]+) \| tokens per second:")
TIMER_ROW = re.compile(r"^    (\S+) \.+: \(([0-9.]+), ([0-9.]+)\)$", re.MULTILINE)
ITERATIONS = 3
REPO = Path(__file__).resolve().parents[2]
WANDB = importlib.util.find_spec("wandb") is not None  # in requirements.txt; optional for pretrain.py


def _scalars(folder):
    """{tag: {step: value}} of the TensorBoard event files in folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def _wandb_records(run_file):
    """The protobuf records of an offline W&B run file (LevelDB log format: 32 KiB blocks of chunks with a
    7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last), after W&B's 7-byte file header."""
    from wandb.proto import wandb_internal_pb2
    data, position, pending = Path(run_file).read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # block trailer
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history(run_file):
    """(run record, {step: {key: value}})."""
    run, history = None, {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
    return run, history


def _norm(tensors):
    return math.sqrt(sum(tensor.double().pow(2).sum().item() for tensor in tensors))


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """TP 2 x PP 2 with every logging flag, TensorBoard and an offline W&B run, saved at the end."""
    root = tmp_path_factory.mktemp("logged")
    flags = TINY + layout_flags(2, 2) + LOG_FLAGS + [
        "--train-iters", str(ITERATIONS), "--eval-interval", str(ITERATIONS), "--eval-iters", "1",
        "--timing-log-level", "2", "--tensorboard-dir", str(root / "tensorboard"), "--tensorboard-queue-size", "5",
        "--save", str(root / "checkpoints")]
    if WANDB:
        flags += ["--wandb-project", "megatron-ds-test", "--wandb-exp-name", "logged-run",
                  "--wandb-save-dir", str(root / "wandb")]
    result = launch(4, flags, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert_succeeded(result, tail=4000)
    return root, result.stdout


def test_iteration_line_and_timers(logged_run):
    _, output = logged_run
    assert sorted(losses(output)) == list(range(1, ITERATIONS + 1))  # the line still parses as before
    lines = [line for line in output.splitlines() if line.startswith(" iteration ")]
    assert all(ADDED_FIELDS.search(line) for line in lines), lines
    blocks = output.split("(min, max) time across ranks (ms):")[1:]
    assert len(blocks) == ITERATIONS
    for block in blocks:
        rows = TIMER_ROW.findall(block.split(" iteration ")[0].split(" validation ")[0])
        assert [name for name, _, _ in rows] == PIPELINE_TIMERS  # level 2, Megatron's order
        assert all(0 < float(fastest) <= float(slowest) for _, fastest, slowest in rows), rows
    validation = re.search(r" validation loss at iteration 3 \| lm loss value: ([0-9.E+-]+) \| lm loss PPL: "
                           r"([0-9.E+-]+) \|", output)
    assert float(validation.group(2)) == pytest.approx(math.exp(float(validation.group(1))), rel=1e-5)
    assert output.count("--log-memory-to-tensorboard: no CUDA device") == 1  # CPU: said once


def test_the_theoretical_memory_line_is_the_planners_for_the_runs_flags(logged_run, tmp_path):
    """Megatron's "Theoretical memory footprints" line, once, from the logging rank: tools/plan.py's memory for its
    pipeline stage, the last, with the same flags (its peak without the runtime overhead); no measured line on a
    CPU."""
    _, output = logged_run
    lines = re.findall(r"^Theoretical memory footprints: .*$", output, re.MULTILINE)
    assert len(lines) == 1, lines
    flags = TINY + layout_flags(2, 2) + ["--train-iters", str(ITERATIONS)]
    plan = subprocess.run([sys.executable, "tools/plan.py", *flags, "--world-size", "4", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert_succeeded(plan, tail=2000)
    stage = json.loads(plan.stdout)["plan"]["memory"]["per_stage"][-1]
    states = stage["weights"] + stage["gradients"] + stage["grad_accumulation"] + stage["optimizer"]
    assert lines[0] == (f"Theoretical memory footprints: weight and optimizer={states / 2**20:.2f} MB, "
                        f"activation={stage['activations'] / 2**20:.2f} MB, "
                        f"total={(stage['total'] - stage['overhead']) / 2**20:.2f} MB")
    assert "memory (MB) | allocated:" not in output


def test_tensorboard_scalars_of_each_flag(logged_run):
    root, output = logged_run
    scalars = _scalars(root / "tensorboard")
    steps = list(range(1, ITERATIONS + 1))
    for tag in (["lm loss", "batch-size", "world-size", "params-norm", "num-zeros", "iteration-time"]
                + [f"{name}-time" for name in PIPELINE_TIMERS] + OPTIMIZER_SCALARS):
        assert sorted(scalars.get(tag, {})) == steps, tag
    assert set(scalars["batch-size"].values()) == {4}  # the global batch
    assert set(scalars["world-size"].values()) == {4}
    assert all(value > 0 for name in PIPELINE_TIMERS for value in scalars[f"{name}-time"].values())
    assert not any(tag.startswith("mem-") for tag in scalars)  # CPU
    assert scalars["validation ppl"][ITERATIONS] == pytest.approx(
        math.exp(scalars["validation lm loss"][ITERATIONS]), rel=1e-5)

    printed = {int(it): (int(zeros), float(norm)) for it, (zeros, norm) in
               zip(sorted(losses(output)), ADDED_FIELDS.findall(output))}
    for step in steps:
        assert scalars["num-zeros"][step] == printed[step][0]
        assert scalars["params-norm"][step] == pytest.approx(printed[step][1], abs=1e-3)

    # the whole model once (TP shards merged, the tied embedding counted once), as the checkpoint holds it
    full = full_state(root / "checkpoints" / f"global_step{ITERATIONS}")
    assert 0 <= scalars["num-zeros"][ITERATIONS] < sum(weight.numel() for weight in full.weights.values())
    assert scalars["params-norm"][ITERATIONS] == pytest.approx(_norm(full.weights.values()), rel=1e-6)
    states = full.optimizer.values()
    for kind, key in (("weight", "fp32"), ("momentum", "exp_avg"), ("variance", "exp_avg_sq")):
        tensors = [state[key].double() for state in states]
        assert scalars[f"optimizer/{kind}_l2"][ITERATIONS] == pytest.approx(_norm(tensors), rel=1e-5), kind
        assert scalars[f"optimizer/{kind}_l1"][ITERATIONS] == pytest.approx(
            sum(t.abs().sum().item() for t in tensors), rel=1e-5), kind
        assert scalars[f"optimizer/{kind}_abs_max"][ITERATIONS] == pytest.approx(
            max(t.abs().max().item() for t in tensors), rel=1e-6), kind
    assert scalars["optimizer/variance_sqrt_l1"][ITERATIONS] == pytest.approx(
        sum(state["exp_avg_sq"].double().sqrt().sum().item() for state in states), rel=1e-5)


@pytest.mark.skipif(not WANDB, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_run_holds_the_same_scalars(logged_run):
    root, _ = logged_run
    run_files = list((root / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, run_files  # one run: the logging rank only
    run, history = _wandb_history(run_files[0])
    assert (run.project, run.display_name) == ("megatron-ds-test", "logged-run")
    scalars = _scalars(root / "tensorboard")
    assert sorted(history) == list(range(1, ITERATIONS + 1))
    for tag, values in scalars.items():
        for step, value in values.items():
            assert history[step][tag] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)


def test_exit_duration_stops_a_long_run_after_the_iteration_that_passes_it(tmp_path):
    """Started 61 s "ago" (tests/support/backdated_start.py), --exit-duration-in-mins 1 is past after iteration 1:
    every rank stops there, the checkpoint is saved and the notice names the duration. bf16 and data
    parallelism: the plain engine's timers and BF16_Optimizer's statistics."""
    save = tmp_path / "checkpoints"
    flags = TINY + ["--train-iters", "1000", "--eval-interval", "1000", "--bf16", "--exit-duration-in-mins", "1",
                    "--save", str(save), "--timing-log-level", "1", "--log-params-norm", "--log-num-zeros-in-grad"]
    result = launch(2, flags, program=("-m", "tests.support.backdated_start", "61"))
    output = result.stdout
    assert_succeeded(result, tail=4000)
    assert list(losses(output)) == [1]
    notice = re.search(r"exiting at iteration 1: training has run ([0-9.]+) minutes \(--exit-duration-in-mins 1; "
                       r"checkpoint saved\)", output)
    assert notice and float(notice.group(1)) >= 1.0, output[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    rows = TIMER_ROW.findall(output)
    assert [name for name, _, _ in rows] == ["forward-backward", "grads-all-reduce", "optimizer"]  # level 1
    zeros, norm = ADDED_FIELDS.search(output).groups()
    weights = full_state(save / "global_step1").weights.values()
    assert float(norm) == pytest.approx(_norm(weights), abs=1e-3)
