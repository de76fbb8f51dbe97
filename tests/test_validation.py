"""Bad command lines and DeepSpeed JSONs make `pretrain.py` exit with status 2 and a message naming the flags
and values, before any process group exists: as a plain process with the launcher's environment, and under
torchrun on every rank."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data "
        "--vocab-size 128").split()
HEADER = "megatron_ds: error: invalid arguments:"
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")
MISSING, DIRECTORY = object(), object()  # special --deepspeed_config values

class Case(NamedTuple):
    argv: list
    world: int
    ds: object
    header: str
    expect: list
    marks: object


def case(name, *flags, world=1, ds=None, expect=(), header=HEADER, base=BASE, marks=()):
    """expect: one substring per reported problem ("{path}" = the JSON's path); ds: the JSON as a dict, as raw
    text, MISSING or DIRECTORY."""
    return name, Case(base + list(flags), world, ds, header, list(expect), marks)


CASES = dict([
    case("tp-pp-vs-world", "--tensor-model-parallel-size", "4", world=6,
         expect=["--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 = 4 does not divide the world "
                 "size 6"]),
    case("heads-vs-tp", "--tensor-model-parallel-size", "3", world=3,
         expect=["--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
                 "--num-key-value-heads 4 is not divisible by --tensor-model-parallel-size 3"]),
    case("kv-heads-vs-tp", "--tensor-model-parallel-size", "4", "--num-key-value-heads", "2", world=4,
         expect=["--num-key-value-heads 2 is not divisible by --tensor-model-parallel-size 4"]),
    case("kv-heads-vs-heads", "--num-query-groups", "3",
         expect=["--num-key-value-heads 3 does not divide --num-attention-heads 4"]),
    case("layers-vs-pp", "--num-layers", "3", "--pipeline-model-parallel-size", "2", world=2,
         expect=["--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"]),
    case("global-batch", "--micro-batch-size", "2", "--global-batch-size", "6", world=2,
         expect=["--global-batch-size 6 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"]),
    case("seq-vs-positions", "--max-position-embeddings", "8",
         expect=["--seq-length 16 exceeds --max-position-embeddings 8"]),
    case("fp16-and-bf16", "--fp16", "--bf16", expect=["--fp16 and --bf16 are mutually exclusive"]),
    case("fp16-on-cpu", "--fp16", expect=["--fp16 needs a GPU"],
         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only without CUDA")),
    *[case(f"zero{stage}-with-pp", "--zero-stage", str(stage), "--pipeline-model-parallel-size", "2", world=2,
           expect=[f"--zero-stage {stage} with --pipeline-model-parallel-size 2"]) for stage in (2, 3)],
    case("non-positive", "--hidden-size", "0", "--micro-batch-size", "-1",
         expect=["--hidden-size must be positive, got 0", "--micro-batch-size must be positive, got -1"]),
    case("json-global-batch", "--global-batch-size", "4", ds={"train_batch_size": 8},
         expect=['--global-batch-size 4 conflicts with "train_batch_size": 8 in {path}']),
    case("json-micro-batch", "--micro-batch-size", "1", ds={"train_micro_batch_size_per_gpu": 2},
         expect=['--micro-batch-size 1 conflicts with "train_micro_batch_size_per_gpu": 2 in {path}']),
    case("json-precision", "--fp16", ds={"bf16": {"enabled": True}},
         expect=['--fp16 conflicts with "bf16": {"enabled": true} in {path}']),
    case("json-zero", "--zero-stage", "1", ds={"zero_optimization": {"stage": 3}},
         expect=['--zero-stage 1 conflicts with "zero_optimization.stage": 3 in {path}']),
    case("json-clip", "--clip-grad", "0.5", ds={"gradient_clipping": 1.0},
         expect=['--clip-grad 0.5 conflicts with "gradient_clipping": 1.0 in {path}']),
    case("json-accumulation", "--micro-batch-size", "2", "--global-batch-size", "8", world=2,
         ds={"gradient_accumulation_steps": 4},
         expect=['"gradient_accumulation_steps": 4 in {path} does not match global batch 8']),
    case("json-missing", ds=MISSING, expect=["--deepspeed_config {path}: file not found"]),
    case("json-unreadable", ds=DIRECTORY, expect=["--deepspeed_config {path}: cannot read it as JSON"]),
    case("json-syntax", ds='{"train_batch_size": 8,', expect=["--deepspeed_config {path}: cannot read it as JSON"]),
    case("json-not-object", ds="[1, 2]", expect=["--deepspeed_config {path}: expected a JSON object, got list"]),
    case("json-optimizer", ds={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
         expect=['{path} defines "optimizer"']),
    case("json-scheduler", ds={"scheduler": {"type": "WarmupLR"}}, expect=['{path} defines "scheduler"']),
    case("sp-without-tp", "--sequence-parallel",
         expect=["--sequence-parallel needs --tensor-model-parallel-size > 1"]),
    case("sp-seq-vs-tp", "--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "18",
         "--max-position-embeddings", "32", world=4,
         expect=["--sequence-parallel: --seq-length 18 is not divisible by --tensor-model-parallel-size 4"]),
    case("recompute-conflict", "--recompute-activations", "--recompute-granularity", "full",
         expect=["--recompute-activations (selective) conflicts with --recompute-granularity full"]),
    case("no-data", base=[flag for flag in BASE if flag != "--mock-data"],
         expect=["give exactly one source of training data (--mock-data, --data-path or --train-data-path), "
                 "got none"]),
    case("two-data-sources", "--data-path", "some/prefix",
         expect=["give exactly one source of training data (--mock-data, --data-path or --train-data-path), "
                 "got --mock-data, --data-path"]),
    case("missing-dataset", "--train-data-path", "no/such/prefix",
         base=[flag for flag in BASE if flag != "--mock-data"],
         expect=["--train-data-path no/such/prefix: no/such/prefix.idx not found",
                 "--train-data-path no/such/prefix: no/such/prefix.bin not found"]),
    case("bad-blend-weights", "--data-path", "0", "a", "0", "b",
         base=[flag for flag in BASE if flag != "--mock-data"],
         expect=["--data-path weights sum to 0"]),
    case("tokenizer-file-missing", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "none.model",
         expect=["--tokenizer-model none.model: file not found"]),
    case("unknown-flag", "--no-such-flag", "3", header="pretrain.py: error: unrecognized arguments: --no-such-flag 3"),
    case("profile-window", "--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
         "--profile-step-end", "3", expect=["--profile-step-start 3 and --profile-step-end 3: need 1 <= start < end"]),
    case("profile-past-end", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
         "--profile-step-end", "5", expect=["--profile-step-end 5 is past --train-iters 1"]),
    case("profile-ranks", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
         "--profile-step-end", "2", "--profile-ranks", "0", "2", world=2,
         expect=["--profile-ranks [2] outside the world of 2 ranks"]),
    case("profile-nsys-on-cpu", "--profile", "--profile-step-start", "1", "--profile-step-end", "2",
         expect=["--profile without --use-pytorch-profiler drives CUDA's profiler API"],
         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA profiler API exists with a GPU")),
    case("json-string-batch", ds={"train_batch_size": "auto"}, expect=["train_batch_size"]),
    case("json-bool-block", ds={"bf16": True}, expect=["bf16"]),
    case("json-zero-accumulation", ds={"train_batch_size": 8, "gradient_accumulation_steps": 0},
         expect=["gradient_accumulation_steps"]),
])


def clean_env(**extra):
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def deepspeed_json(tmp_path, ds):
    if ds is MISSING:
        return tmp_path / "missing.json"
    if ds is DIRECTORY:
        return tmp_path
    path = tmp_path / "ds.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    return path


def run_case(directory, spec):
    """Run pretrain.py as rank 0 of a `spec.world`-rank launch; returns the result and the expected messages."""
    argv, expect = spec.argv, spec.expect
    if spec.ds is not None:
        path = deepspeed_json(directory, spec.ds)
        argv = argv + ["--deepspeed_config", str(path)]
        expect = [text.replace("{path}", str(path)) for text in expect]
    result = subprocess.run([sys.executable, "pretrain.py", *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env=clean_env(WORLD_SIZE=str(spec.world), RANK="0", LOCAL_RANK="0"))
    return result, expect


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Each run spends ~2 s importing DeepSpeed: start every selected, unskipped case up front, one per core."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_invalid_arguments_exit_2"
             and not any(mark.args[0] for mark in item.iter_markers("skipif"))]
    pool = ThreadPoolExecutor(os.cpu_count() or 2)
    yield {name: pool.submit(run_case, tmp_path_factory.mktemp(name), CASES[name]) for name in names}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("name", [pytest.param(name, marks=spec.marks) for name, spec in CASES.items()])
def test_invalid_arguments_exit_2(launched, name):
    result, expect = launched[name].result()
    stderr = result.stderr
    assert "Traceback" not in stderr + result.stdout, stderr
    assert result.returncode == 2, stderr
    assert CASES[name].header in stderr
    problems = [line for line in stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == len(expect), stderr  # one line per problem, no spurious ones
    for text in expect:
        assert any(text in line for line in problems), f"{text!r} not in:\n{stderr}"


def test_invalid_arguments_under_torchrun():
    """Every rank validates on its own and exits 2; nobody waits in a collective. The long monitor interval
    lets all four ranks print before torchrun tears down the survivors of the first failure."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "4", "--monitor-interval", "5", "pretrain.py",
               *BASE, "--tensor-model-parallel-size", "3"]
    result = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=60, env=clean_env())
    output = result.stdout
    assert result.returncode != 0, output
    assert output.count(HEADER) == 4, output
    assert output.count("--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 does not divide "
                        "the world size 4") == 4, output
    assert output.count("--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3") == 4, output
