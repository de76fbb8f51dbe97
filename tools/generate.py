"""Generate text from a megatron_ds checkpoint (any saved layout) or a Hugging Face model folder, with a KV
cache; greedy unless --temperature > 0. Tensor parallelism: launch it like pretrain.py, TP = the number
of ranks (one pipeline stage); a Mixture of Experts can also split its experts over
--moe-expert-parallel-size ranks (TP = ranks / that).

    python tools/generate.py --load ckpt --prompt "Once upon a time" --max-new-tokens 32
    torchrun --nproc_per_node 2 tools/generate.py --load ckpt --prompt-ids 5,17,42 --output-format json
    python tools/generate.py --hf hf_model --prompt-file prompts.txt --temperature 0.8 --top-p 0.9 --seed 7
    torchrun --nproc_per_node 4 tools/generate.py --load moe_ckpt --moe-expert-parallel-size 2 --prompt-ids 5,17
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ds.launch.runtime import finish_distributed, prepare_host  # noqa: E402

prepare_host()  # DeepSpeed picks its accelerator at import time

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ds.checkpointing import CheckpointError  # noqa: E402
from megatron_ds.conversion import convert  # noqa: E402
from megatron_ds.core import parallel_state  # noqa: E402
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_ds.inference.generation import SamplingParams, build_model, generate, setup_expert_parallel  # noqa: E402


class _AppendPrompt(argparse.Action):
    """--prompt and --prompt-ids into one list, in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), (self.const, values)])


def build_parser():
    parser = argparse.ArgumentParser(prog="generate.py", allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="our checkpoint folder")
    source.add_argument("--hf", help="a Hugging Face model folder (GPT2LMHeadModel, LlamaForCausalLM, "
                                     "MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                     "Qwen3MoeForCausalLM or DeepseekV3ForCausalLM)")
    parser.add_argument("--load-iteration", default=None)
    parser.add_argument("--prompt", action=_AppendPrompt, const="text", dest="prompts", default=[],
                        help="a prompt (repeatable)")
    parser.add_argument("--prompt-file", help="one prompt per line")
    parser.add_argument("--prompt-ids", action=_AppendPrompt, const="ids", dest="prompts", default=[],
                        help="comma-separated token ids, e.g. 5,17,42 (repeatable; for checkpoints without a "
                             "tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    parser.add_argument("--output-format", choices=["text", "json"], default="text")
    parser.add_argument("--moe-expert-parallel-size", type=int, default=1,
                        help="Mixture of Experts: split the experts over this many ranks (TP = ranks / this)")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                        help="set by the deepspeed launcher")
    return parser


def _init_parallel(expert_parallel_size):
    """TP = world size / expert-parallel size when launched (torchrun, deepspeed, mpirun, srun); a single process
    needs no process group. Returns TP."""
    from megatron_ds.core.parallel_layout import generation_layout
    from megatron_ds.launch.launcher_env import launcher_world_size
    layout = generation_layout(launcher_world_size(), expert_parallel_size)
    if layout.world_size > 1:
        from megatron_ds.launch.runtime import init_distributed
        init_distributed()
        parallel_state.initialize_model_parallel(layout.tensor, 1)
    return layout.tensor


def _check_experts(shape, expert_parallel_size):
    """Whether the model (its shape, files.model_shape) has experts; ValueError when they do not split over EP."""
    from megatron_ds.checkpointing import files
    if not files.is_moe(shape):
        if expert_parallel_size != 1:
            raise ValueError(f"--moe-expert-parallel-size {expert_parallel_size}: the model has no experts")
        return False
    uneven = sorted({count for count in shape["num_experts"] if count % expert_parallel_size})
    if uneven:
        raise ValueError(f"--moe-expert-parallel-size {expert_parallel_size} does not divide the experts of the "
                         f"model's MoE layers ({', '.join(map(str, uneven))})")
    return True


def _tokenizer(model_args):
    from megatron_ds.data.tokenizers import build_tokenizer
    try:
        return build_tokenizer(model_args.get("tokenizer_type") or "NullTokenizer",
                               tokenizer_model=model_args.get("tokenizer_model"),
                               vocab_file=model_args.get("vocab_file"), merge_file=model_args.get("merge_file"),
                               vocab_size=model_args.get("vocab_size"))
    except ValueError as error:
        print(f"generate: note: no tokenizer ({error}); use --prompt-ids", file=sys.stderr)
        return None


def _prompts(args, tokenizer):
    """[(prompt text or None, token ids)] in command-line order, then the --prompt-file lines."""
    given = list(args.prompts)
    if args.prompt_file:
        with open(args.prompt_file) as handle:
            given += [("text", line.rstrip("\n")) for line in handle if line.strip()]
    if any(kind == "text" for kind, _ in given) and tokenizer is None:
        raise ValueError("text prompts need the checkpoint's tokenizer; give --prompt-ids")
    prompts = [(value, tokenizer.encode(value)) if kind == "text"
               else (None, [int(i) for i in value.replace(" ", "").split(",") if i]) for kind, value in given]
    if not prompts:
        raise ValueError("give --prompt, --prompt-file or --prompt-ids")
    return prompts


def _completion(tokenizer, prompt_ids, generated):
    """The generated text as it continues the prompt (decoding both keeps the spacing between them)."""
    if tokenizer is None:
        return None
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(list(prompt_ids) + list(generated))
    return full_text[len(prompt_text):] if full_text.startswith(prompt_text) else tokenizer.decode(generated)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        tp = _init_parallel(args.moe_expert_parallel_size)
        if args.hf:
            full = convert.read_hf(args.hf, tp=tp)
        else:
            full, _ = convert.load_full(args.load, args.load_iteration, with_optimizer=False)
        experts = _check_experts(full.model, args.moe_expert_parallel_size)
        tokenizer = _tokenizer(full.args)
        prompts = _prompts(args, tokenizer)
    except (CheckpointError, ValueError) as error:
        print(f"generate: error: {error}", file=sys.stderr, flush=True)
        return 2
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if experts and dist.is_initialized():
        setup_expert_parallel(args.moe_expert_parallel_size, bool(full.args.get("enable_expert_tensor_parallelism")))
    model_parallel_cuda_manual_seed(args.seed)
    model = build_model(full, args.moe_expert_parallel_size)
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, not args.ignore_eod)
    vocab_size = full.args["vocab_size"]
    max_length = full.model["max_position_embeddings"]  # None without learned positions
    for text, ids in prompts:
        generated = generate(model, ids, params, vocab_size, eod=full.args.get("eod"), seed=args.seed,
                             max_length=max_length)
        completion = _completion(tokenizer, ids, generated)
        if not rank0:
            continue
        if args.output_format == "json":
            print(json.dumps({"prompt": text, "prompt_ids": ids, "generated_ids": generated, "text": completion}),
                  flush=True)
        elif text is not None:
            print(text + completion, flush=True)
        else:
            shown = completion if completion is not None else ",".join(map(str, generated))
            print(f"{','.join(map(str, ids))} -> {shown.lstrip()}", flush=True)
    if dist.is_initialized():
        finish_distributed()
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
