"""Megatron-DeepSpeed's GPT/LLaMA launch scripts as command lines for pretrain.py and tools/plan.py: their flag
sets (megatron_deepspeed_scripts.json) with the placeholders pointed at files a test makes."""
import json
import math
from pathlib import Path

from megatron_ds.arguments.checks import fp16_supported
from tests.support.corpus import sample_sentences

SCRIPTS = {name: script for name, script in
           json.loads((Path(__file__).with_name("megatron_deepspeed_scripts.json")).read_text()).items()
           if not name.startswith("_")}


def make_tokenizer_files(folder):
    """{flag: path} for a small GPT-2 BPE (vocab.json, merges.txt) and a SentencePiece model with an eos."""
    import sentencepiece
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(sample_sentences(200), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(folder))
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(sample_sentences(300)), vocab_size=100,
                                             model_prefix=str(folder / "sp"), minloglevel=2)
    return {"--vocab-file": str(folder / "vocab.json"), "--merge-file": str(folder / "merges.txt"),
            "--tokenizer-model": str(folder / "sp.model")}


def command_line(name, files, folder, replace=None, ds_config=None):
    """The script's flags as an argv: tokenizer files from `files`, its DeepSpeed JSON (or `ds_config`) written
    into `folder`, and `replace` ({flag: value, True for a switch, None to drop}) applied; other placeholders
    stay as the script has them."""
    script = SCRIPTS[name]
    replace = replace or {}
    argv, seen = [], set()
    for flag, value in script["flags"]:
        seen.add(flag)
        if flag in replace:
            value = replace[flag]
            if value is None:
                continue
        elif flag in files:
            value = files[flag]
        elif flag == "--deepspeed_config":
            config = script["ds_config"] if ds_config is None else ds_config
            value = str(_write_json(folder / (name.replace("/", "_") + ".json"), config or {}))
        argv += _tokens(flag, value)
    for flag, value in replace.items():
        if flag not in seen and value is not None:
            argv += _tokens(flag, value)
    return argv


def _tokens(flag, value):
    """--flag, its value or values (None or True: a switch)."""
    if value is None or value is True:
        return [flag]
    return [flag] + [str(v) for v in (value if isinstance(value, list) else [value])]


def world_size(name, argv):
    """TP x Ulysses SP x PP x a data-parallel size that fits the script's batch sizes: the one its DeepSpeed JSON
    implies (train_batch_size / micro batch / accumulation), else the largest at which its batches (and ramp-up)
    divide, and, for Megatron's interleaved schedule, leave a multiple of PP micro-batches."""
    def number(flag, default):
        return int(argv[argv.index(flag) + 1]) if flag in argv else default
    config = SCRIPTS[name]["ds_config"] or {}
    micro = number("--micro-batch-size", config.get("train_micro_batch_size_per_gpu", 1))
    batches = [number("--global-batch-size", config.get("train_batch_size", micro))]
    if isinstance(config.get("gradient_accumulation_steps"), int):
        batches = [batches[0] // config["gradient_accumulation_steps"]]
    if "--rampup-batch-size" in argv:
        start = argv.index("--rampup-batch-size") + 1
        batches += [int(argv[start]), int(argv[start + 1])]
    data_parallel = math.gcd(*[batch // micro for batch in batches])
    pipeline = number("--pipeline-model-parallel-size", 1)
    if "--num-layers-per-virtual-pipeline-stage" in argv:
        data_parallel = max(size for size in range(1, data_parallel + 1)
                            if data_parallel % size == 0 and all(batch // micro // size % pipeline == 0
                                                                  for batch in batches))
    return (number("--tensor-model-parallel-size", 1) * number("--ds-sequence-parallel-size", 1)
            * number("--pipeline-model-parallel-size", 1) * data_parallel)


def _write_json(path, config):
    path.write_text(json.dumps(config))
    return path


def make_datasets(folder, files):
    """{tokenizer: prefix} of a small indexed dataset per tokenizer family (GPT-2 BPE, SentencePiece)."""
    import subprocess
    import sys

    from tests.support.corpus import write_jsonl
    from tests.support.launch import REPO
    # enough that the scripts' 2% validation split holds an evaluation's samples (checked at start-up)
    corpus = write_jsonl(folder / "corpus.jsonl", sample_sentences(1600))
    tokenizers = {"gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["--vocab-file"],
                           "--merge-file", files["--merge-file"]],
                  "sentencepiece": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                    files["--tokenizer-model"]]}
    prefixes = {}
    for family, flags in tokenizers.items():
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--append-eod",
                        "--output-prefix", str(folder / family), *flags], cwd=REPO, check=True, capture_output=True)
        prefixes[family] = str(folder / f"{family}_text_document")
    return prefixes


# the model and the run made tiny; everything else as the script has it
TINY = {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
        "--max-position-embeddings": 32, "--micro-batch-size": 2, "--log-interval": 1, "--eval-iters": 1,
        "--eval-interval": 2, "--save-interval": 1000, "--rampup-batch-size": None}
TINY_TEACHER = {"--num-layers-teacher": 3, "--hidden-size-teacher": 64, "--num-attention-heads-teacher": 4}
# what a CPU cannot run: NCCL, and fp16 where its oneDNN has none (bf16 instead)
FP16 = fp16_supported()
CPU = {"--distributed-backend": "gloo", **({} if FP16 else {"--fp16": None})}


def is_moe(name):
    """The script trains a Mixture of Experts (--num-experts above 1; Megatron-DeepSpeed's dense scripts pass 1)."""
    value = dict(SCRIPTS[name]["flags"]).get("--num-experts") or "1"
    return max(int(count) for count in ([value] if isinstance(value, str) else value)) > 1


def distils(name):
    return "--kd" in dict(SCRIPTS[name]["flags"])


def tiny_teacher_command_line(files, datasets, folder):
    """pretrain.py's flags that train a tiny GPT-2 teacher for the distillation scripts (TINY's shape, 3 layers,
    the GPT-2 tokenizer and data), saved in `folder`."""
    return ["--num-layers", str(TINY_TEACHER["--num-layers-teacher"]), "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-2", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", files["--vocab-file"], "--merge-file", files["--merge-file"], "--data-path",
            datasets["gpt2"], "--data-cache-path", str(folder / "cache"), "--save", str(folder / "teacher")]


def tiny_command_line(name, files, datasets, folder, iterations=3, teacher=None):
    """(argv, ranks): the script's flags on a tiny model for `iterations` iterations on at most 4 CPU ranks (TP
    and PP 2 where the script uses them), its fp16 as it is where this CPU has fp16 (else bf16), its DeepSpeed JSON
    given the same batch sizes and precision; data, tokenizer and output folders from the test; a distillation
    script's teacher: the checkpoint folder `teacher` (tiny_teacher_command_line's)."""
    flags = dict((flag, value) for flag, value in SCRIPTS[name]["flags"])
    tp = 2 if int(flags.get("--tensor-model-parallel-size", 1)) > 1 else 1
    pp = 2 if int(flags.get("--pipeline-model-parallel-size", 1)) > 1 else 1
    dp = 2 if tp * pp <= 2 else 1
    global_batch = 2 * dp * 2  # micro batch 2, two micro-batches per iteration
    as_bf16 = "--bf16" in flags or ("--fp16" in flags and not FP16)
    schedule = ({"--train-samples": iterations * global_batch} if "--train-samples" in flags
                else {"--train-iters": iterations})
    family = "sentencepiece" if "--tokenizer-model" in flags else "gpt2"
    replace = {**TINY, **CPU, **schedule, "--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
               "--global-batch-size": global_batch, "--data-path": datasets[family],
               "--data-cache-path": str(folder / "cache"), "--save": str(folder / "save"),
               "--load": str(folder / "save"),
               "--tensorboard-dir": str(folder / "tensorboard"), "--bf16": True if as_bf16 else None,
               "--num-key-value-heads": 2 if "--num-key-value-heads" in flags else None,
               "--ffn-hidden-size": 128 if "--ffn-hidden-size" in flags else None}
    if distils(name):
        replace.update(TINY_TEACHER, **{"--load-teacher": str(teacher)})
    if "--ds-sequence-parallel-fpdt" in flags:  # 2 Ulysses ranks over 2 chunks of the tiny sequence; a CPU has
        # no accelerator streams for FPDT's offloading (refused by name here)
        replace.update({"--ds-sequence-parallel-size": 2, "--ds-sequence-parallel-fpdt-chunk-size": 16,
                        "--ds-sequence-parallel-fpdt-offloading": None})
    if is_moe(name):  # 4 experts over the data-parallel ranks
        replace.update({"--num-experts": 4, "--moe-expert-parallel-size": dp})
    config = {key: value for key, value in (SCRIPTS[name]["ds_config"] or {}).items()
              if key != "gradient_accumulation_steps" and not (key == "fp16" and as_bf16)}
    config.update(train_batch_size=global_batch, train_micro_batch_size_per_gpu=2)
    if config.get("curriculum_learning", {}).get("enabled"):  # its sequence-length warm-up, over the tiny run
        config["curriculum_learning"] = {**config["curriculum_learning"], "min_difficulty": 8, "max_difficulty": 32,
                                         "schedule_config": {"total_curriculum_step": iterations, "difficulty_step": 8}}
    if as_bf16:
        config["bf16"] = {"enabled": True}
    return command_line(name, files, folder, replace, config), tp * pp * dp
