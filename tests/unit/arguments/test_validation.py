"""Bad command lines and DeepSpeed JSONs: parse_args raises one ArgumentsError with one line per problem,
each naming the flags and values (in-process; tests/unit/training/test_validation.py and
tests/e2e/test_validation.py run pretrain.py itself)."""
import json
from typing import NamedTuple

import pytest
import torch

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.arguments.checks import fp16_supported
from tests.support.flags import TINY_MODEL as BASE

MISSING, DIRECTORY = object(), object()  # special --deepspeed_config values


class Case(NamedTuple):
    argv: list
    world: int
    ds: object
    expect: list
    marks: object


def case(name, *flags, world=1, ds=None, expect=(), base=BASE, marks=()):
    """expect: one substring per reported problem ("{path}" = the JSON's path); ds: the JSON as a dict, as raw
    text, MISSING or DIRECTORY."""
    return name, Case(base + list(flags), world, ds, list(expect), marks)


CASES = dict([
    case("tp-pp-vs-world", "--tensor-model-parallel-size", "4", world=6,
         expect=["--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 = 4 does not divide the world "
                 "size 6"]),
    case("heads-vs-tp", "--tensor-model-parallel-size", "3", world=3,
         expect=["--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
                 "--num-key-value-heads 4 is not divisible by --tensor-model-parallel-size 3",
                 "--ffn-hidden-size 128 (the default for --hidden-size 32) is not divisible by "
                 "--tensor-model-parallel-size 3"]),
    case("default-swiglu-ffn-vs-tp", "--tensor-model-parallel-size", "3", "--num-attention-heads", "6",
         "--hidden-size", "384", "--swiglu", world=3,
         expect=["--ffn-hidden-size 1024 (the default for --hidden-size 384 with --swiglu) is not divisible by "
                 "--tensor-model-parallel-size 3"]),
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
    case("fp16-without-support", "--fp16", expect=["--fp16 needs a GPU"],
         marks=pytest.mark.skipif(fp16_supported(), reason="fp16 is refused only where DeepSpeed has none")),
    *[case(f"zero{stage}-with-pp", "--zero-stage", str(stage), "--pipeline-model-parallel-size", "2", world=2,
           expect=[f"--zero-stage {stage} with --pipeline-model-parallel-size 2"]) for stage in (2, 3)],
    case("non-positive", "--hidden-size", "0", "--micro-batch-size", "-1",
         expect=["--hidden-size must be positive, got 0", "--micro-batch-size must be positive, got -1"]),
    case("negative-num-workers", "--num-workers", "-1", expect=["--num-workers -1: must be >= 0"]),
    case("moe-experts-vs-ep-vs-stage", "--num-experts", "6", "--moe-expert-parallel-size", "4", world=6,
         expect=["--num-experts 6 is not divisible by --moe-expert-parallel-size 4",
                 "--moe-expert-parallel-size 4 does not divide the 6 ranks of a pipeline stage"]),
    case("moe-pyramid-length", "--num-experts", "2", "4", "8", "--num-layers", "4",
         expect=["--num-experts 2 4 8: give one count, or one per MoE layer (2: --num-layers 4 / --expert-interval "
                 "2)"]),
    case("moe-topk", "--num-experts", "2", "--topk", "3",
         expect=["--topk 3 must be between 1 and the experts of a layer (2)"]),
    case("moe-expert-tp-and-sp", "--num-experts", "4", "--tensor-model-parallel-size", "2",
         "--enable-expert-tensor-parallelism", "--sequence-parallel", "--disable-moe-token-dropping",
         "--moe-expert-parallel-size", "2", world=2,
         expect=["--moe-expert-parallel-size 2 does not divide the data-parallel size 1 (world size 2 / TP 2 / PP 1)",
                 "--num-experts 4 with --sequence-parallel: DeepSpeed's MoE splits replicated tokens"]),
    case("ulysses", "--ds-sequence-parallel-size", "4", "--seq-length", "30", "--max-position-embeddings", "30",
         "--num-attention-heads", "6", "--hidden-size", "48", "--reset-attention-mask", "--num-experts", "4",
         "--moe-expert-parallel-size", "2", "--tensor-model-parallel-size", "2", world=16,
         expect=["--ds-sequence-parallel-size 4: --seq-length 30 is not divisible by SP 4",
                 "--ds-sequence-parallel-size 4: the 3 attention heads of a TP rank (--num-attention-heads 6 / "
                 "--tensor-model-parallel-size 2) do not split over SP 4",
                 "--ds-sequence-parallel-size 4 with --reset-attention-mask: not built",
                 "--ds-sequence-parallel-size 4 with --num-experts above 1: not built"]),
    case("ulysses-world", "--ds-sequence-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", world=4,
         expect=["--tensor-model-parallel-size 2 x --ds-sequence-parallel-size 2 x --pipeline-model-parallel-size 2 "
                 "= 8 does not divide the world size 4"]),
    case("context-parallel", "--context-parallel-size", "4", "--seq-length", "36", "--max-position-embeddings", "36",
         "--reset-attention-mask", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         world=8, expect=["--context-parallel-size 4: --seq-length 36 is not divisible by 2 x CP 4 (each CP rank holds "
                          "two chunks of the sequence",
                          "--tensor-model-parallel-size 2 x --context-parallel-size 4 x --pipeline-model-parallel-size "
                          "2 = 16 does not divide the world size 8",
                          "--context-parallel-size 4 with --reset-attention-mask: not built"]),
    case("context-parallel-with-ulysses-and-sp", "--context-parallel-size", "2", "--ds-sequence-parallel-size", "2",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "24",
         "--max-position-embeddings", "24", world=8,
         expect=["--context-parallel-size 2: --seq-length 24 is not divisible by 2 x CP 2 x SP 2 x "
                 "--tensor-model-parallel-size 2 (--sequence-parallel)"]),
    case("a2a-p2p-without-sizes", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", world=4,
         expect=["--cp-comm-type a2a+p2p with --context-parallel-size 4 needs --hierarchical-context-parallel-sizes "
                 "a b with a x b = 4 (a: Ulysses' all-to-all inside, b: the ring across), got nothing"]),
    case("a2a-p2p-wrong-sizes", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
         "--hierarchical-context-parallel-sizes", "2", "3", world=4,
         expect=["needs --hierarchical-context-parallel-sizes a b with a x b = 4 (a: Ulysses' all-to-all inside, b: "
                 "the ring across), got 2 3"]),
    case("cp-comm-types", "--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a",
         "--hierarchical-context-parallel-sizes", "2", "1", world=2,
         expect=["--cp-comm-type p2p a2a: a communication type per layer is not built in megatron_ds",
                 "--hierarchical-context-parallel-sizes 2 1 is for --cp-comm-type a2a+p2p (got p2p)"]),
    case("a2a-and-ulysses", "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--ds-sequence-parallel-size",
         "2", world=4, expect=["--cp-comm-type a2a with --context-parallel-size 2 and --ds-sequence-parallel-size 2: "
                               "both ask for DeepSpeed-Ulysses"]),
    case("context-parallel-deepspeed-moe", "--context-parallel-size", "2", "--num-experts", "2", world=2,
         expect=["--context-parallel-size 2 with DeepSpeed-MoE"]),
    case("fpdt", "--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size", "6",
         "--ds-sequence-parallel-size", "4", "--num-key-value-heads", "2", "--context-parallel-size", "2",
         "--qk-layernorm", world=8,
         expect=["--ds-sequence-parallel-fpdt: --seq-length 16 is not a multiple of "
                 "--ds-sequence-parallel-fpdt-chunk-size 6",
                 "--ds-sequence-parallel-fpdt: --ds-sequence-parallel-fpdt-chunk-size 6 does not split over "
                 "--ds-sequence-parallel-size 4",
                 "--ds-sequence-parallel-fpdt: the 2 key/value head(s) of a TP rank (--num-key-value-heads 2 / "
                 "--tensor-model-parallel-size 1) are fewer than --ds-sequence-parallel-size 4",
                 "--ds-sequence-parallel-fpdt with --context-parallel-size 2",
                 "--ds-sequence-parallel-fpdt with --qk-layernorm",
                 "--ds-sequence-parallel-fpdt with --attention-dropout 0.1: without the flash-attn package"]),
    case("fpdt-offloading-alone", "--ds-sequence-parallel-fpdt-offloading",
         expect=["--ds-sequence-parallel-fpdt-offloading needs --ds-sequence-parallel-fpdt"]),
    case("fpdt-offloading-on-a-cpu", "--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size", "8",
         "--ds-sequence-parallel-fpdt-offloading", "--attention-dropout", "0",
         expect=["--ds-sequence-parallel-fpdt-offloading needs a GPU: DeepSpeed's FPDT moves the 2 chunks' keys"],
         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs FPDT's offloading")),
    case("moe-stage-without-experts", "--num-experts", "4", "--pipeline-model-parallel-size", "4",
         "--num-layers", "4", world=4,
         expect=["--pipeline-model-parallel-size 4 with --expert-interval 2: pipeline stage(s) 0, 2 (1 of "
                 "--num-layers 4 each) would hold no MoE layer"]),
    case("moe-zero-3", "--num-experts", "2", "--zero-stage", "3",
         expect=["--zero-stage 3 with --num-experts 2: DeepSpeed's ZeRO-3 does not shard MoE experts"]),
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
    *[case(f"rotary-percent-{value}", "--use-rotary-position-embeddings", "--rotary-percent", value,
           expect=[f"--rotary-percent must be in (0, 1] (the fraction of each head's channels RoPE rotates), "
                   f"got {float(value)}"]) for value in ("0", "1.5")],
    case("rotary-percent-odd-dim", "--use-rotary-position-embeddings", "--rotary-percent", "0.375",
         expect=["--rotary-percent 0.375: head dim 8 = --hidden-size 32 / --num-attention-heads 4 x 0.375 = 3 rotated "
                 "channels per head; RoPE needs an even integer >= 2"]),
    case("rotary-percent-fraction", "--position-embedding-type", "rope", "--kv-channels", "16", "--rotary-percent",
         "0.3",
         expect=["--rotary-percent 0.3: --kv-channels 16 x 0.3 = 4.8 rotated channels per head"]),
    case("rotary-percent-one-channel", "--use-rotary-position-embeddings", "--rotary-percent", "0.125",
         expect=["--rotary-percent 0.125: head dim 8 = --hidden-size 32 / --num-attention-heads 4 x 0.125 = 1 "
                 "rotated"]),
    case("json-string-batch", ds={"train_batch_size": "auto"}, expect=["train_batch_size"]),
    case("json-bool-block", ds={"bf16": True}, expect=["bf16"]),
    case("json-zero-accumulation", ds={"train_batch_size": 8, "gradient_accumulation_steps": 0},
         expect=["gradient_accumulation_steps"]),
])




def deepspeed_json(tmp_path, ds):
    if ds is MISSING:
        return tmp_path / "missing.json"
    if ds is DIRECTORY:
        return tmp_path
    path = tmp_path / "ds.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    return path


@pytest.mark.parametrize("name", [pytest.param(name, marks=spec.marks) for name, spec in CASES.items()])
def test_invalid_arguments_are_reported_together(tmp_path, name):
    spec = CASES[name]
    argv, expect = spec.argv, spec.expect
    if spec.ds is not None:
        path = deepspeed_json(tmp_path, spec.ds)
        argv = argv + ["--deepspeed_config", str(path)]
        expect = [text.replace("{path}", str(path)) for text in expect]
    with pytest.raises(ArgumentsError) as raised:
        parse_args(argv, world_size=spec.world)
    message = str(raised.value)
    assert message.startswith("invalid arguments:\n"), message
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == len(expect), message  # one line per problem, no spurious ones
    for text in expect:
        assert any(text in line for line in problems), f"{text!r} not in:\n{message}"


def test_unknown_flags_and_bad_values_are_reported_with_the_other_problems():
    """argparse alone stops at its first complaint; here unknown flags, bad values and the checks' problems come
    in one message."""
    argv = BASE + ["--no-such-flag", "3", "--num-layers", "x", "--normalization", "BatchNorm",
                   "--tensor-model-parallel-size", "3"]
    with pytest.raises(ArgumentsError) as raised:
        parse_args(argv, world_size=3)
    problems = raised.value.problems
    assert problems[:2] == ["argument --num-layers: invalid int value: 'x'",
                            "argument --normalization: invalid choice: 'BatchNorm' "
                            "(choose from 'LayerNorm', 'RMSNorm')"]
    assert problems[2].startswith("unrecognized arguments: --no-such-flag 3")
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in problems
    with pytest.raises(ArgumentsError, match="the following arguments are required: --hidden-size"):
        parse_args(["--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "8", "--mock-data"],
                   world_size=1)


def test_problems_of_flags_json_and_files_are_reported_together(tmp_path):
    """A layout error, a DeepSpeed JSON conflict and a missing dataset in one message."""
    path = deepspeed_json(tmp_path, {"train_batch_size": 8})
    argv = [flag for flag in BASE if flag != "--mock-data"] + [
        "--num-layers", "3", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
        "--train-data-path", "no/such/prefix", "--deepspeed_config", str(path)]
    with pytest.raises(ArgumentsError) as raised:
        parse_args(argv, world_size=2)
    message = str(raised.value)
    for text in ("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
                 f'--global-batch-size 4 conflicts with "train_batch_size": 8 in {path}',
                 "--train-data-path no/such/prefix: no/such/prefix.idx not found"):
        assert text in message


def test_checkpoint_flags_are_validated_before_any_process_group():
    base = BASE + ["--train-iters", "8"]
    with pytest.raises(ArgumentsError) as error:
        parse_args(base + ["--save-interval", "0", "--exit-interval", "-1", "--load-iteration", "x"], world_size=1)
    message = str(error.value)
    for expected in ("--save-interval must be positive, got 0", "--exit-interval must be positive, got -1",
                     "--load-iteration needs --load", "--load-iteration must be an iteration number or 'release'"):
        assert expected in message, message
    assert parse_args(base + ["--save-interval", "4"], world_size=1).warnings == (
        "--save-interval 4 without --save: nothing will be saved",)
    args = parse_args(base + ["--load", "ckpt", "--ckpt-step", "release", "--finetune"], world_size=1)
    assert (args.load_iteration, args.finetune, args.no_load_optim) == ("release", True, False)
