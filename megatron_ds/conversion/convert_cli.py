"""The command line of tools/convert_checkpoint.py (see there)."""
import argparse
import sys

from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.conversion import convert
from megatron_ds.conversion.huggingface import MOE_LAYERS
from megatron_ds.core.pipeline_split import add_split_flags, split_from_flags

DESCRIPTION = """Reshape megatron_ds checkpoints to another tensor/pipeline-parallel layout, and convert them to and
from Hugging Face `transformers` models (GPT-2 family <-> GPT2LMHeadModel, LLaMA family <-> LlamaForCausalLM, LLaMA
family with experts in every layer <-> MixtralForCausalLM, with --add-qkv-bias <-> Qwen2ForCausalLM, with
--qk-layernorm <-> Qwen3ForCausalLM), and to and from Megatron-DeepSpeed's checkpoints (GPT and
LLaMA families, with their optimizer states). A Mixture of Experts checkpoint is read at any expert-parallel
size and written with every expert in each file (--target-expert-parallel-size checks and records the size to train
at). A Mixtral comes in as DeepSpeed-MoE (Megatron-DeepSpeed's MoE flags) or, with --moe-layer dropless, as the
dropless MoE layer (Megatron-Core's flags); either exports back with --to-hf, a dropless model only with Mixtral's
routing (softmax, top-k renormalised, no shared expert, no moved expert bias, every layer MoE). A Qwen3-MoE comes in
as the dropless layer, and a dropless model with --qk-layernorm exports as one (dense layers and norm_topk_prob
false held too)."""
EXAMPLES = """examples:
  convert_checkpoint.py --load ckpt --save ckpt_tp1_pp2 --target-tensor-parallel-size 1 \\
      --target-pipeline-model-parallel-size 2
  convert_checkpoint.py --to-hf --load ckpt --save hf_model
  convert_checkpoint.py --from-hf hf_model --save ckpt_from_hf --target-tensor-parallel-size 2 \\
      --target-pipeline-model-parallel-size 2
  convert_checkpoint.py --from-hf mixtral --save ckpt_dropless --moe-layer dropless --target-expert-parallel-size 4
  convert_checkpoint.py --from-megatron-deepspeed mds_ckpt --save ckpt_from_mds
  convert_checkpoint.py --to-megatron-deepspeed --load ckpt --save mds_ckpt --target-data-parallel-size 8"""


def build_parser():
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", allow_abbrev=False, description=DESCRIPTION,
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--to-hf", action="store_true", help="write a Hugging Face model folder to --save")
    mode.add_argument("--from-hf", metavar="HF_DIR", help="read this Hugging Face model folder")
    mode.add_argument("--from-megatron-deepspeed", metavar="MDS_DIR",
                      help="read this Megatron-DeepSpeed checkpoint folder (its `latest` names the checkpoint; "
                           "--load-iteration another): weights, fp32 master weights, Adam moments, iteration, data "
                           "position, tokens and LR schedule")
    mode.add_argument("--to-megatron-deepspeed", action="store_true",
                      help="write --load in Megatron-DeepSpeed's format (checkpoint version 3.0) to --save: weights, "
                           "fp32 master weights and Adam moments (its ZeRO-1 files), iteration, data position, "
                           "tokens and LR schedule; no RNG states")
    parser.add_argument("--load", help="our checkpoint folder (its pointers name the checkpoint)")
    parser.add_argument("--load-iteration", default=None, help="this iteration instead of the pointers' one")
    parser.add_argument("--save", required=True, help="output folder")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None)
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--target-data-parallel-size", type=int, default=None,
                        help="--to-megatron-deepspeed: the data-parallel size of its ZeRO-1 files (DeepSpeed loads "
                             "them at that size; default: the source run's)")
    parser.add_argument("--target-expert-parallel-size", type=int, default=None,
                        help="Mixture of Experts: the expert-parallel size to train the result with "
                             "(--moe-expert-parallel-size, or the dropless layer's --expert-model-parallel-size; "
                             "checked against the experts; the files hold every expert, so any valid size loads "
                             "them)")
    parser.add_argument("--target-expert-tensor-parallelism", choices=["on", "off"], default=None,
                        help="Mixture of Experts: split the experts over TP in the files (train with "
                             "--enable-expert-tensor-parallelism) or keep them whole (default: as the source)")
    parser.add_argument("--no-optim", action="store_true",
                        help="reshape, --to-megatron-deepspeed: drop the optimizer states")
    parser.add_argument("--moe-layer", choices=MOE_LAYERS, default=None,
                        help="--from-hf of a MixtralForCausalLM: its experts in DeepSpeed-MoE (deepspeed-moe, the "
                             "default; train with --topk, --expert-interval ...) or in the dropless MoE layer "
                             "(dropless; train with --moe-router-topk, --moe-ffn-hidden-size ..., as printed); a "
                             "Qwen3MoeForCausalLM's: dropless only")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="--from-hf: vocabulary padding (default: the exporting run's, else 128)")
    parser.add_argument("--trim-vocab-padding", action="store_true",
                        help="--to-hf: keep only the tokenizer's rows (default: all rows, padding included, so a "
                             "round trip reproduces every tensor)")
    add_split_flags(parser.add_argument_group(
        "the target's pipeline split (reshape, --from-hf, --from-megatron-deepspeed): pretrain.py's flags, one "
        "model stage per pipeline rank; default the even split"))
    return parser


def _target_split(parser, args):
    """The split the written checkpoint is to have; refused where the output is not our checkpoint."""
    split = split_from_flags(vars(args))
    if not split.is_even and (args.to_hf or args.to_megatron_deepspeed):
        why = "--to-hf writes no pipeline stages" if args.to_hf else "--to-megatron-deepspeed writes the even split"
        parser.error(f"{split.describe()}: a pipeline split is for our checkpoints (reshape, --from-hf, "
                     f"--from-megatron-deepspeed); {why}")
    return split


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    split = _target_split(parser, args)
    try:
        if args.from_hf:
            convert.from_hf(args.from_hf, args.save, args.target_tensor_parallel_size or 1,
                            args.target_pipeline_model_parallel_size or 1, args.make_vocab_size_divisible_by,
                            args.target_expert_parallel_size, args.target_expert_tensor_parallelism,
                            args.moe_layer, split)
        elif args.from_megatron_deepspeed:
            convert.from_megatron_deepspeed(args.from_megatron_deepspeed, args.save, args.target_tensor_parallel_size,
                                            args.target_pipeline_model_parallel_size, args.load_iteration, split)
        elif not args.load:
            parser.error("give --load (reshape, --to-hf or --to-megatron-deepspeed), --from-hf or "
                         "--from-megatron-deepspeed")
        elif args.to_hf:
            convert.to_hf(args.load, args.save, args.load_iteration, args.trim_vocab_padding)
        elif args.to_megatron_deepspeed:
            convert.to_megatron_deepspeed(args.load, args.save, args.target_tensor_parallel_size,
                                          args.target_pipeline_model_parallel_size, args.target_data_parallel_size,
                                          args.load_iteration, not args.no_optim)
        else:
            if args.target_tensor_parallel_size is None or args.target_pipeline_model_parallel_size is None:
                parser.error("reshaping needs --target-tensor-parallel-size and --target-pipeline-model-parallel-size")
            convert.reshape(args.load, args.save, args.target_tensor_parallel_size,
                            args.target_pipeline_model_parallel_size, args.load_iteration, not args.no_optim,
                            args.target_expert_parallel_size, args.target_expert_tensor_parallelism, split)
    except CheckpointError as error:
        print(f"convert_checkpoint: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0

