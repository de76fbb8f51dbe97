"""pretrain.py's flags: Megatron-LM's and Megatron-DeepSpeed's names, meanings and defaults.

Only the parser lives here; what the flags imply is worked out in `megatron_ds.arguments.resolve`.
"""
import argparse
import ast
import functools
import sys
import types

from megatron_ds.arguments import compat
from megatron_ds.core.pipeline_schedules import SCHEDULES
from megatron_ds.core.pipeline_split import add_split_flags
from megatron_ds.core.transformer.transformer_config import (
    ATTENTION_BACKENDS,
    FP8_FORMATS,
    FP8_RECIPES,
    FUSION_BACKENDS,
    LLAMA3_SCALING_DEFAULTS,
    MOE_LOAD_BALANCING_TYPES,
    MOE_SCORE_FUNCTIONS,
    MOE_TOKEN_DISPATCHERS,
    MOE_TOKEN_DROP_POLICIES,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ROPE_TYPES,
    YARN_DEFAULTS,
)
from megatron_ds.data.tokenizers import TOKENIZER_ALIASES, TOKENIZER_TYPES


def _normalization(text):
    """Megatron-LM's LayerNorm / RMSNorm, or Megatron-DeepSpeed's layernorm / rmsnorm."""
    return {name.lower(): name for name in NORMALIZATIONS}.get(text.lower(), text)


def _add_model_args(parser):
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, required=True)
    group.add_argument("--hidden-size", type=int, required=True)
    group.add_argument("--num-attention-heads", type=int, required=True)
    group.add_argument("--num-key-value-heads", "--num-query-groups", dest="num_key_value_heads", type=int,
                       default=None, help="grouped-query attention: number of key/value heads (default: heads)")
    group.add_argument("--group-query-attention", action="store_true",
                       help="accepted for Megatron-LM compatibility; GQA is on when --num-query-groups < heads")
    group.add_argument("--ffn-hidden-size", type=int, default=None)
    group.add_argument("--kv-channels", type=int, default=None)
    group.add_argument("--seq-length", type=int, required=True)
    group.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--normalization", type=_normalization, choices=NORMALIZATIONS, default="LayerNorm",
                       help="LayerNorm or RMSNorm (any case: Megatron-DeepSpeed writes layernorm / rmsnorm)")
    group.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--position-embedding-type", choices=(*POSITION_EMBEDDING_TYPES, "yarn"),
                       default="learned_absolute",
                       help="yarn: Megatron-LM's GPT spelling of rope with --rope-type yarn")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="same as --position-embedding-type rope")
    group.add_argument("--rotary-base", "--rotary-position-embeddings-theta", dest="rotary_base", type=float,
                       default=10000.0, help="RoPE theta (Megatron-DeepSpeed: --rotary-position-embeddings-theta)")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="fraction of each head's dimensions that RoPE rotates (the rest pass unrotated)")
    _add_rope_scaling_args(group)
    group.add_argument("--disable-bias-linear", action="store_true")
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="a bias on the QKV projection, also with --disable-bias-linear (Qwen2)")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="--normalization over each query and key head's channels, before RoPE: one weight of "
                            "head size each for every head (Qwen3's q_norm / k_norm)")
    _add_multi_latent_attention_args(group)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    for flag in ("--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-triton", "--use-flash-attn-v1",
                 "--use-flash-attn-builder"):
        group.add_argument(flag, action="store_true", help="fused attention: --attention-backend sdpa (the default)")
    group.add_argument("--no-query-key-layer-scaling", dest="apply_query_key_layer_scaling", action="store_false",
                       help="accepted: Q K^T is never scaled by the layer number here (the softmax runs in fp32)")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="sdpa",
                       help="sdpa: torch's scaled_dot_product_attention (flash/memory-efficient kernels, no "
                            "s x s tensor kept); local: explicit softmax(QK^T)V; flash: megatron_ds's blocked "
                            "causal attention with a hashed dropout mask, in --fusion-backend's implementation "
                            "(sdpa becomes it where --fusion-backend auto compiles on a CPU)")


def _add_multi_latent_attention_args(group):
    """DeepSeek-V3's multi-latent attention, in Megatron-LM's names and defaults."""
    group.add_argument("--multi-latent-attention", action="store_true",
                       help="multi-latent attention (DeepSeek-V2/V3): queries, keys and values through low-rank "
                            "latents, a decoupled rotary key shared by the heads")
    group.add_argument("--q-lora-rank", type=int, default=None,
                       help="MLA: the query latent's rank (DeepSeek-V3: 1536); unset: queries through one "
                            "projection")
    group.add_argument("--kv-lora-rank", type=int, default=32,
                       help="MLA: the key-value latent's rank (DeepSeek-V3: 512)")
    group.add_argument("--qk-head-dim", type=int, default=128,
                       help="MLA: each query and key head's channels without RoPE (the head dim is this plus "
                            "--qk-pos-emb-head-dim)")
    group.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                       help="MLA: each query and key head's channels RoPE rotates (the rotary key's, shared)")
    group.add_argument("--v-head-dim", type=int, default=128, help="MLA: each value head's channels")


def _add_rope_scaling_args(group):
    """YaRN (DeepSeek-V3's context extension) and LLaMA-3.1's RoPE scaling, in Megatron's names and defaults."""
    group.add_argument("--rope-type", choices=ROPE_TYPES, default=None,
                       help="rope: plain RoPE (the default); yarn: RoPE with YaRN's context extension, set by "
                            "--rotary-scaling-factor, --original-max-position-embeddings, --beta-fast, --beta-slow, "
                            "--mscale, --mscale-all-dim")
    group.add_argument("--rotary-scaling-factor", type=float, default=YARN_DEFAULTS["rotary_scaling_factor"],
                       help="YaRN: how many times the context is extended (DeepSeek-V3: 40)")
    group.add_argument("--original-max-position-embeddings", "--yarn-original-max-position-embeddings",
                       dest="original_max_position_embeddings", type=int, default=None,
                       help="YaRN, required: the context the model was trained at before the extension "
                            "(DeepSeek-V3: 4096)")
    group.add_argument("--beta-fast", "--yarn-beta-fast", dest="beta_fast", type=float,
                       default=YARN_DEFAULTS["beta_fast"],
                       help="YaRN: frequencies turning more often than this over the original context keep their "
                            "RoPE frequency")
    group.add_argument("--beta-slow", "--yarn-beta-slow", dest="beta_slow", type=float,
                       default=YARN_DEFAULTS["beta_slow"],
                       help="YaRN: frequencies turning less often than this are divided by the factor; those "
                            "between, blended")
    group.add_argument("--mscale", type=float, default=YARN_DEFAULTS["mscale"],
                       help="YaRN: cos and sin are multiplied by get_mscale(factor, mscale) / get_mscale(factor, "
                            "mscale-all-dim), get_mscale(s, m) = 0.1 m ln s + 1")
    group.add_argument("--mscale-all-dim", type=float, default=YARN_DEFAULTS["mscale_all_dim"],
                       help="YaRN: see --mscale (DeepSeek-V3: both 1)")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="LLaMA-3.1's RoPE scaling: low frequencies divided by --rope-scaling-factor, high "
                            "ones kept, those between blended (frequency factors 1 and 4, original context 8192)")
    group.add_argument("--rope-scaling-factor", type=float, default=LLAMA3_SCALING_DEFAULTS["rope_scaling_factor"],
                       help="LLaMA-3.1's RoPE scaling factor")


def _add_fusion_args(parser):
    group = parser.add_argument_group("fused kernels (core/fusions)")
    group.add_argument("--fusion-backend", choices=FUSION_BACKENDS,
                       default="auto", help="auto: Triton on GPUs, the model's reference code on CPUs (cold "
                       "compiles cost more than they save there); an unavailable explicit choice is an error")
    for flag, help_text in (("--no-masked-softmax-fusion", "scale + mask + softmax of the local attention"),
                            ("--no-persist-layer-norm", "LayerNorm / RMSNorm"),
                            ("--no-rope-fusion", "rotary embedding of q and k"),
                            ("--no-bias-gelu-fusion", "bias + GeLU"), ("--no-bias-swiglu-fusion", "SwiGLU"),
                            ("--no-bias-dropout-fusion", "bias + dropout + residual add"),
                            ("--no-cross-entropy-fusion", "chunked vocab-parallel cross entropy")):
        group.add_argument(flag, action="store_true", help=f"use the model's reference code for {help_text}")


def _add_memory_args(parser):
    group = parser.add_argument_group("activation memory")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="split LayerNorm/dropout/residual regions along the sequence across TP ranks")
    group.add_argument("--recompute-activations", action="store_true",
                       help="selective recompute of the core attention (= --recompute-granularity selective)")
    group.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None)
    group.add_argument("--recompute-method", "--activations-checkpoint-method", dest="recompute_method",
                       choices=RECOMPUTE_METHODS, default=None,
                       help="full recompute: uniform = chunks of --recompute-num-layers layers; block = only the "
                            "first --recompute-num-layers layers of each pipeline stage (default uniform)")
    group.add_argument("--recompute-num-layers", "--activations-checkpoint-num-layers", "--checkpoint-num-layers",
                       dest="recompute_num_layers",
                       type=int, default=None, help="default 1")
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="Megatron-DeepSpeed's name for full recompute of every layer (= --recompute-granularity "
                            "full; --recompute-method uniform unless given)")
    group.add_argument("--distribute-saved-activations", "--distribute-checkpointed-activations",
                       dest="distribute_saved_activations", action="store_true",
                       help="full recompute: split each saved layer input across the TP ranks (Megatron-DeepSpeed: "
                            "--distribute-checkpointed-activations)")
    group.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                       help="full recompute (needs --checkpoint-activations or --recompute-granularity full; the "
                            "same chunks) through DeepSpeed's activation checkpointing and RNG tracker, with the "
                            "DeepSpeed JSON's activation_checkpointing block")
    for flag, text in (("--partition-activations", "split each checkpointed input across the TP ranks (not with "
                                                   "--sequence-parallel)"),
                       ("--contigious-checkpointing", "copy the partitioned inputs into preallocated contiguous "
                                                      "buffers (needs --partition-activations)"),
                       ("--checkpoint-in-cpu", "keep the checkpointed inputs in CPU memory (nothing to move on a "
                                               "CPU device)"),
                       ("--synchronize-each-layer", "synchronize the device around each checkpointed chunk"),
                       ("--profile-backward", "log the time of each checkpointed forward and backward")):
        group.add_argument(flag, action="store_true", help=f"with --deepspeed-activation-checkpointing: {text}")


def _add_training_args(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="default: from the DeepSpeed JSON, or 1")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: from the DeepSpeed JSON, or micro batch x data-parallel size")
    group.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="grow the global batch from START by INCREMENT over the first SAMPLES samples")
    group.add_argument("--train-iters", type=int, default=None,
                       help="iterations to train (or --train-samples; one of the two is required)")
    group.add_argument("--train-samples", type=int, default=None,
                       help="samples to train (iterations follow from the global batch and its ramp-up); the LR "
                            "schedule then counts samples (--lr-warmup-samples, --lr-decay-samples)")
    group.add_argument("--train-tokens", type=int, default=None,
                       help="Megatron-DeepSpeed: stop once this many tokens (samples x --seq-length) are consumed "
                            "(checked before each iteration; the final checkpoint is saved)")
    group.add_argument("--lr", type=float, default=1e-4)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    group.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    group.add_argument("--lr-decay-tokens", type=int, default=None,
                       help="Megatron-DeepSpeed: decay over this many tokens (overrides iterations and samples)")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-samples", type=int, default=0)
    group.add_argument("--lr-warmup-tokens", type=int, default=None,
                       help="Megatron-DeepSpeed: warm up over this many tokens (overrides iterations and samples)")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="fraction of the decay iterations (or samples) to warm up over")
    group.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                       help="adam: AdamW (decoupled weight decay, as Megatron); sgd: SGD with --sgd-momentum")
    group.add_argument("--sgd-momentum", type=float, default=0.9)
    group.add_argument("--cpu-optimizer", action="store_true",
                       help="DeepSpeed's CPU Adam: the optimizer step runs on the CPU (with ZeRO offload)")
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=None, help="default: DeepSpeed JSON, or 1.0")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                       action="store_false", help="train on after a NaN/Inf loss or gradient norm (fp32 and bf16 "
                                                  "stop there by default, before any save; fp16 skips steps)")
    group.add_argument("--rerun-mode", choices=["disabled", "validate_results", "report_stats"], default="disabled",
                       help="validate_results: an iteration whose loss fails validation (NaN/Inf, a spike) is "
                            "computed again from the same state before its optimizer step, telling a transient "
                            "device fault (exit 16) from the data's or the model's (exit 17); report_stats: every "
                            "--rerun-stats-interval-th iteration is computed twice and how often the ranks' results "
                            "reproduce is reported every log interval (megatron_ds/training/resilience/rerun.py)")
    group.add_argument("--rerun-stats-interval", type=int, default=1,
                       help="with --rerun-mode report_stats: compute every Nth iteration twice")
    group.add_argument("--check-for-spiky-loss", action="store_true",
                       help="with --rerun-mode validate_results: a loss above --spiky-loss-factor x the largest of "
                            "the last 100 iterations fails validation")
    group.add_argument("--spiky-loss-factor", type=float, default=10.0)
    group.add_argument("--skip-spiky-batches", action="store_true",
                       help="a spike that reproduces drops its global batch (no optimizer step) instead of exit 17")
    group.add_argument("--error-injection-rate", type=int, default=0,
                       help="fail every Nth result validation on purpose, for testing (0: never)")
    group.add_argument("--error-injection-type", choices=["correct_result", "transient_error", "persistent_error"],
                       default="transient_error")
    group.add_argument("--max-consecutive-skipped-steps", type=int, default=100,
                       help="stop once DeepSpeed skips more optimizer steps than this in a row (gradient overflow: "
                            "fp16 loss scaling, or ZeRO's overflow check); 0: no limit")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true", default=None)
    group.add_argument("--fp16", action="store_true", default=None)
    group.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    group.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    group.add_argument("--min-loss-scale", type=float, default=1.0)
    group.add_argument("--loss-scale-window", type=int, default=1000)
    group.add_argument("--hysteresis", type=int, default=2)


def _add_parallel_args(parser):
    group = parser.add_argument_group("parallelism and distributed")
    group.add_argument("--DDP-impl", dest="DDP_impl", choices=["local", "torch", "FSDP"], default="local",
                       help="accepted for Megatron-DeepSpeed scripts: DeepSpeed's engine does the data parallelism")
    group.add_argument("--no-async-tensor-model-parallel-allreduce", dest="async_tensor_model_parallel_allreduce",
                       action="store_false", help="accepted; TP all-reduces are not overlapped here either way")
    group.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                       action="store_false", help="accepted for Megatron-DeepSpeed scripts (which need it without "
                       "apex): autograd adds the weight gradients into DeepSpeed's buffers here, there is no fused "
                       "weight-gradient kernel to turn off")
    group.add_argument("--no-scatter-gather-tensors-in-pipeline", dest="scatter_gather_tensors_in_pipeline",
                       action="store_false", help="pipeline messages travel whole between stages instead of split "
                       "over the TP ranks")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="context parallelism: the ranks splitting each sample's sequence (2 chunks each, for "
                            "causal load balance), attention exchanging keys and values per --cp-comm-type")
    group.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                       choices=["p2p", "allgather", "all_gather", "a2a", "a2a+p2p"],
                       help="p2p: ring attention, key/value blocks passed round the CP ranks while one computes; "
                            "allgather (or all_gather): keys and values gathered at once; a2a: DeepSpeed-Ulysses "
                            "(as --ds-sequence-parallel-size); a2a+p2p: Ulysses inside a ring, sized by "
                            "--hierarchical-context-parallel-sizes. One type for every layer")
    group.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
                       help="a2a+p2p: a b with a x b = --context-parallel-size (a adjacent ranks in Ulysses' "
                            "all-to-all, b of those groups in a ring)")
    group.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                       help="the pipeline schedule (default 1f1b, DeepSpeed's): zbh1 (zero bubble, weight gradients "
                            "deferred), interleaved (Megatron's virtual stages), dualpipev (DeepSeek's V shape)")
    group.add_argument("--enable-zbh1-pipeline", action="store_true",
                       help="Megatron-DeepSpeed's spelling of --pipeline-schedule zbh1")
    group.add_argument("--enable-zbh1-exact-semantics", action="store_true",
                       help="ZB-H1 keeping 1F1B's exact update order (Megatron-DeepSpeed's flag; implies zbh1)")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Megatron's interleaved schedule: N layers per virtual stage (v = layers / (PP x N))")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Megatron's interleaved schedule: v virtual stages per pipeline rank")
    add_split_flags(group)
    group.add_argument("--zero-stage", type=int, default=None, help="default: DeepSpeed JSON, or 1")
    group.add_argument("--no-pipeline-parallel", action="store_true",
                       help="Megatron-DeepSpeed compatibility: PP = 1 always uses the plain DeepSpeed engine")
    group.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                       help="default: nccl with CUDA, gloo without")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                       help="collective timeout; the watchdog ends every rank within about a minute of any "
                            "rank failing, whatever this is")
    group.add_argument("--distributed-port", type=int, default=None,
                       help="rendezvous port under mpirun/srun (default: MASTER_PORT, else 29500); overrides "
                            "MASTER_PORT for every launcher when given")
    group.add_argument("--print-topology", action="store_true",
                       help="print every rank's host and its TP/PP/DP groups at start-up")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                       help="set by the deepspeed launcher")


def _add_logging_args(parser):
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--tensorboard-dir", default=None)
    group.add_argument("--tensorboard-queue-size", type=int, default=1000,
                       help="TensorBoard events held before a write to disk is forced")
    for flag, text in (("--log-timers-to-tensorboard", "the forward, backward and optimizer times"),
                       ("--log-batch-size-to-tensorboard", "the global batch size"),
                       ("--log-validation-ppl-to-tensorboard", "the validation perplexity"),
                       ("--log-optimizer-states-to-tensorboard", "norms of the Adam moments"),
                       ("--log-memory-to-tensorboard", "allocated and reserved device memory"),
                       ("--log-world-size-to-tensorboard", "the world size")):
        group.add_argument(flag, action="store_true", help=f"write {text} to TensorBoard")
    group.add_argument("--log-params-norm", action="store_true", help="log the norm of the parameters")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the number of zeros in the gradients")
    group.add_argument("--log-straggler", action="store_true",
                       help="every log interval, each rank's compute time per iteration (wall time less the waits "
                            "in collectives and pipeline sends/receives): the slowest and fastest ranks, and a "
                            "warning for a rank slower than its peers (megatron_ds/training/resilience/stragglers.py)")
    group.add_argument("--straggler-minmax-count", type=int, default=1,
                       help="how many of the slowest and fastest ranks --log-straggler prints")
    group.add_argument("--straggler-threshold", type=float, default=1.2,
                       help="--log-straggler names a rank whose compute time exceeds this x the median of its "
                            "peers (the other ranks of its pipeline stage)")
    group.add_argument("--straggler-intervals", type=int, default=2,
                       help="... for this many log intervals in a row")
    group.add_argument("--disable-straggler-on-startup", action="store_true",
                       help="--log-straggler starts switched off (switch it on through --straggler-ctrlr-port)")
    group.add_argument("--straggler-ctrlr-port", type=int, default=65535,
                       help="with --log-straggler: rank 0 listens on this port; each connection (e.g. curl "
                            "<rank 0 host>:<port>) switches the detector on or off from the next log interval")
    group.add_argument("--timing-log-level", type=int, choices=range(0, 3), default=0,
                       help="0: iteration time only; 1: also forward/backward/optimizer; 2: also finer timers")
    group.add_argument("--wandb-project", default="", help="log to this Weights & Biases project (empty: off)")
    group.add_argument("--wandb-exp-name", default="", help="the Weights & Biases run name")
    group.add_argument("--wandb-save-dir", default="", help="where Weights & Biases writes locally")
    group.add_argument("--exit-duration-in-mins", type=int, default=None,
                       help="save (with --save) and exit once training has run this many minutes (all ranks agree)")
    group.add_argument("--peak-tflops", type=float, default=None,
                       help="per-device peak TFLOP/s for MFU (default: known GPU table, or measured matmul rate)")
    group.add_argument("--profile", nargs="?", const="on", default=None, choices=["on", "pt", "pt-full"],
                       help="profile iterations --profile-step-start .. --profile-step-end - 1 (see "
                            "--use-pytorch-profiler; without it, CUDA's profiler API for nsys); Megatron-DeepSpeed's "
                            "--profile pt is --use-pytorch-profiler, pt-full records call stacks too")
    group.add_argument("--profile_steps", default=None, metavar="START,END",
                       help="Megatron-DeepSpeed's window: iterations START .. END (= --profile-step-start START "
                            "--profile-step-end END+1)")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="with --profile: torch.profiler, a Chrome trace per profiled rank and a table of the "
                            "costliest operators on stdout")
    group.add_argument("--profile-step-start", type=int, default=10)
    group.add_argument("--profile-step-end", type=int, default=12)
    group.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    group.add_argument("--profile-dir", default=None,
                       help="where traces go (default: --tensorboard-dir, else the working directory)")
    group.add_argument("--pipeline-timeline", metavar="DIR", default=None,
                       help="PP > 1: each rank's pipeline instructions with their times as a Chrome trace in DIR, "
                            "for --pipeline-timeline-iterations, else the --profile window, else the three "
                            "iterations after the first; each stage's idle share printed at the end "
                            "(megatron_ds/observability/pipeline_timeline.py)")
    group.add_argument("--pipeline-timeline-iterations", type=int, nargs=2, metavar=("START", "END"), default=None,
                       help="the iterations --pipeline-timeline records: START .. END - 1 (as --profile-step-start "
                            "and --profile-step-end count them)")


def _add_data_args(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... (blended); split by --split")
    group.add_argument("--split", default="969, 30, 1", help="train, valid, test weights for --data-path")
    group.add_argument("--train-data-path", nargs="*", default=None)
    group.add_argument("--valid-data-path", nargs="*", default=None)
    group.add_argument("--test-data-path", nargs="*", default=None)
    group.add_argument("--data-cache-path", default=None, help="where sample indices are cached "
                       "(default: a cache/ folder beside the data)")
    group.add_argument("--mock-data", action="store_true", help="deterministic synthetic token stream")
    group.add_argument("--data-impl", default="infer", help="mmap or infer (Megatron-DeepSpeed): the only .bin/.idx "
                       "format there is, memory-mapped")
    group.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank")
    group.add_argument("--reset-position-ids", action="store_true", help="positions restart after each eod")
    group.add_argument("--reset-attention-mask", action="store_true", help="no attention across eod tokens")
    group.add_argument("--eod-mask-loss", action="store_true", help="no loss on eod tokens")
    group.add_argument("--tokenizer-type", choices=list(TOKENIZER_TYPES) + list(TOKENIZER_ALIASES), default=None,
                       help="default: GPT2BPETokenizer with --vocab-file and --merge-file, else NullTokenizer")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model, or tokenizer.json / folder")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for NullTokenizer")


def _add_deepspeed_args(parser):
    group = parser.add_argument_group("DeepSpeed")
    group.add_argument("--deepspeed", action="store_true", help="accepted; DeepSpeed is always the engine")
    group.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                       help="DeepSpeed JSON, reconciled with the flags (see docs/flags.md)")


def _add_checkpoint_args(parser):
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None, help="folder for checkpoints (DeepSpeed's files plus megatron_ds "
                       "metadata; crash-safe: a save is complete or invisible)")
    group.add_argument("--save-interval", type=int, default=None,
                       help="save every N iterations; with --save a checkpoint is also written at the end")
    group.add_argument("--async-save", action="store_true",
                       help="write checkpoints in the background while training goes on (as crash-safe; a save "
                            "waits for the one before, and the run for the last before it exits)")
    group.add_argument("--load", default=None, help="resume from the checkpoint the folder's pointers name "
                       "(an empty or missing folder: start from scratch); default: --save, so that a launch "
                       "started again after a failure resumes")
    group.add_argument("--load-iteration", "--ckpt-step", dest="load_iteration", default=None,
                       help="load this iteration's checkpoint (or 'release') instead of the pointers' one")
    group.add_argument("--load-tag", default=None,
                       help="Megatron-DeepSpeed's: load this tag folder (global_stepN, iter_NNNNNNN or release) "
                            "instead of the pointers' one; the same as --load-iteration N")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="with --load: stop (exit 2) when the folder holds no checkpoint, instead of starting "
                            "from scratch")
    group.add_argument("--no-load-optim", action="store_true",
                       help="weights, iteration and data position only: fresh Adam moments (the LR schedule goes on)")
    group.add_argument("--no-load-rng", action="store_true", help="do not restore the saved RNG states")
    group.add_argument("--no-load-lr-state", action="store_true",
                       help="do not restore the LR schedule: the flags' schedule from the resumed iteration (from 0 "
                            "with --reset-iteration)")
    group.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler",
                       dest="override_opt_param_scheduler", action="store_true",
                       help="take the schedule's values (LR, minimum, style, warmup, decay) from the flags, not the "
                            "checkpoint (which must otherwise agree); the position is the checkpoint's")
    group.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler",
                       dest="use_checkpoint_opt_param_scheduler", action="store_true",
                       help="take the schedule's values from the checkpoint, whatever the flags say")
    group.add_argument("--reset-iteration", action="store_true",
                       help="load weights, optimizer states and the LR schedule, but start at iteration 0 with no "
                            "consumed samples (data from the start)")
    group.add_argument("--finetune", action="store_true",
                       help="load the weights only and start at iteration 0 (no optimizer, scheduler, RNG or "
                            "data position)")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="save (with --save) and exit after every N-th iteration")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="on SIGTERM finish the iteration, save (with --save) and exit")


def _add_distillation_args(parser):
    """Megatron-DeepSpeed's knowledge distillation (its --kd family, same names and defaults)."""
    group = parser.add_argument_group("knowledge distillation (Megatron-DeepSpeed's --kd)")
    group.add_argument("--kd", action="store_true",
                       help="train the model against a frozen teacher's logits as well as the labels: loss = "
                            "--kd-alpha-ce x language-model loss + --kd-beta-ce x T^2 x KL(teacher || student) at "
                            "temperature T = --kd-temp, the KL averaged over the tokens (Megatron-DeepSpeed's "
                            "weighting; it reads --kd-alpha-ce but weights the language-model loss by 1, so the "
                            "two agree at its default)")
    group.add_argument("--kd-alpha-ce", type=float, default=1.0, help="weight of the language-model loss")
    group.add_argument("--kd-beta-ce", type=float, default=1.0, help="weight of the distillation term")
    group.add_argument("--kd-temp", type=float, default=1.0, help="softmax temperature of the distillation term")
    group.add_argument("--load-teacher", default=None,
                       help="the teacher's checkpoint folder (ours at any layout, or Megatron-DeepSpeed's): its "
                            "weights are read resharded to this run's TP and pipeline stages, its shape from the "
                            "checkpoint")
    for flag in ("--num-layers-teacher", "--hidden-size-teacher", "--num-attention-heads-teacher"):
        group.add_argument(flag, type=int, default=None,
                           help="checked against the teacher's checkpoint (optional: the checkpoint records it)")
    group.add_argument("--num-experts-teacher", type=int, nargs="+", default=[1],
                       help="1: a dense teacher (a Mixture-of-Experts teacher is not built)")


def moe_layer_freq(text):
    """Megatron-LM's --moe-layer-freq: N (every N-th layer from the first is an MoE layer) or a list expression of
    0s and 1s, one per layer, such as "[0]*3+[1]*58" or "([1]*3+[0])*2" (only lists, ints, + and * are read)."""
    text = str(text).strip()
    if "[" not in text:
        return int(text)
    return _pattern(ast.parse(text, mode="eval").body, text)


def _pattern(node, text):
    if isinstance(node, ast.List):
        return [_pattern(element, text) for element in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left, text), _pattern(node.right, text)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"--moe-layer-freq {text!r}: only lists of 0 and 1, integers, + and * are understood")


def _add_dropless_moe_args(parser):
    """Megatron-Core's MoE flags: any of them given selects the dropless layer (core/transformer/dropless_moe.py)
    for --num-experts; Megatron-DeepSpeed's MoE flags select DeepSpeed-MoE. None: not given (resolve fills
    Megatron-Core's default)."""
    group = parser.add_argument_group("Mixture of Experts, Megatron-Core's flags: the dropless layer")
    group.add_argument("--moe-layer-freq", type=moe_layer_freq, default=None,
                       help="N: every N-th layer from the first is an MoE layer; or a pattern, one 0/1 per layer, "
                            "such as \"[0]*3+[1]*58\" (default 1: every layer)")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN (default: "
                       "--ffn-hidden-size)")
    group.add_argument("--moe-router-topk", type=int, default=None, help="experts per token (default 2)")
    group.add_argument("--moe-router-score-function", choices=MOE_SCORE_FUNCTIONS, default=None,
                       help="softmax (default) or sigmoid (DeepSeek-V3)")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="softmax over all experts before the choice (the chosen scores then not normalised)")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="the chosen scores' scale (DeepSeek-V3: 2.5)")
    group.add_argument("--moe-router-num-groups", type=int, default=None,
                       help="group-limited routing: the experts in this many groups")
    group.add_argument("--moe-router-group-topk", type=int, default=None,
                       help="group-limited routing: the groups a token may choose from")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="auxiliary-loss-free balancing: a per-expert bias added to the scores for the choice")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=None,
                       help="the bias's step per iteration (default 1e-3)")
    group.add_argument("--moe-router-load-balancing-type", choices=MOE_LOAD_BALANCING_TYPES, default=None,
                       help="aux_loss (default), seq_aux_loss, global_aux_loss or none")
    group.add_argument("--moe-aux-loss-coeff", type=float, default=None, help="the balance loss's weight (default 0)")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None, help="the router z-loss's weight")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="a shared expert of this FFN beside the routed ones")
    group.add_argument("--moe-shared-expert-gate", action="store_true",
                       help="the shared expert's output scaled by a sigmoid gate (Qwen2-MoE)")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="the experts as grouped GEMMs (torch._grouped_mm), not one GEMM each")
    group.add_argument("--moe-token-dispatcher-type", choices=MOE_TOKEN_DISPATCHERS, default=None,
                       help="alltoall (default): per-expert counts, then the tokens, over the EP group; allgather: "
                            "every EP rank gathers the group's tokens, the weighted sums reduce-scattered back")
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="each expert's capacity, ceil(tokens x topk / experts x factor) of a rank's pairs, the "
                            "rest dropped (unset: dropless)")
    group.add_argument("--moe-token-drop-policy", choices=MOE_TOKEN_DROP_POLICIES, default=None,
                       help="with a capacity: drop the pairs of lowest routing weight (probs, default) or the last "
                            "tokens (position)")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                       help="not built (refused): the experts take uneven counts")
    group.add_argument("--expert-model-parallel-size", type=int, default=None,
                       help="ranks splitting the experts, across TP and data-parallel ranks (default 1)")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="ranks splitting each expert: 1 (experts whole on their rank, MoE parallel folding)")


def _tokens_and_factor(text):
    """TOKENS=FACTOR (a --mtp-loss-scaling-factor-by-tokens entry) -> (int, float)."""
    tokens, separator, factor = text.partition("=")
    try:
        if not separator or int(tokens) < 0:
            raise ValueError
        return int(tokens), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKENS=FACTOR (e.g. 10000000000000=0.1)") from None


def _add_multi_token_prediction_args(parser):
    group = parser.add_argument_group("multi-token prediction (DeepSeek-V3's MTP, Megatron-LM's flags)")
    group.add_argument("--mtp-num-layers", type=int, default=None,
                       help="MTP depth D: modules after the last layer, module k predicting the token k + 1 ahead "
                            "(DeepSeek-V3: 1)")
    group.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                       help="the MTP loss's weight: this times the mean of the D depths' losses joins the "
                            "gradient (the lm loss logged stays the main model's)")
    group.add_argument("--mtp-loss-scaling-factor-by-tokens", type=_tokens_and_factor, nargs="+", default=None,
                       metavar="TOKENS=FACTOR",
                       help="the weight from TOKENS consumed training tokens on (DeepSeek-V3: "
                            "--mtp-loss-scaling-factor 0.3 --mtp-loss-scaling-factor-by-tokens 10000000000000=0.1)")


# Megatron-LM's --fp8-recipe choices built elsewhere only (Transformer Engine's), refused by name (checks.fp8_errors)
UNBUILT_FP8_RECIPES = {"mxfp8": "MXFP8 (Blackwell's 1x32 E8M0 block scales)"}
DEFAULT_FP8_RECIPE = "delayed"  # Megatron-LM's, and Transformer Engine's (Megatron-DeepSpeed's FP8)
# delayed scaling's flags: Megatron-LM's defaults, taken when --fp8-recipe delayed leaves them out
DELAYED_SCALING_DEFAULTS = {"fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent"}


def _add_fp8_args(parser):
    """Megatron-LM's FP8 flags (its Transformer-Engine group) and Megatron-DeepSpeed's spellings of the format."""
    group = parser.add_argument_group("FP8 training (docs/fp8.md)")
    group.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                       help="the transformer layers' linear and expert GEMMs in FP8: e4m3 for every operand, or "
                            "hybrid (E5M2 gradients); default off (the output layer, embedding, norms and attention "
                            "stay in bf16); needs --bf16")
    group.add_argument("--fp8-e4m3", action="store_true", help="Megatron-DeepSpeed's spelling of --fp8-format e4m3")
    group.add_argument("--fp8-hybrid", action="store_true",
                       help="Megatron-DeepSpeed's spelling of --fp8-format hybrid")
    group.add_argument("--fp8-recipe", choices=(*FP8_RECIPES, *UNBUILT_FP8_RECIPES), default=None,
                       help=f"how the scales are chosen: tensorwise, rowwise, or blockwise (DeepSeek-V3's 1x128 "
                            f"tiles and 128x128 weight blocks) from each GEMM's own operands, or delayed (one scale "
                            f"per tensor from earlier steps' amaxes, Transformer Engine's); default "
                            f"{DEFAULT_FP8_RECIPE}, as in Megatron-LM; mxfp8 is refused")
    group.add_argument("--fp8-margin", type=int, default=0, help="scale = fp8_max / amax / 2**margin")
    group.add_argument("--fp8-amax-history-len", type=int, default=None,
                       help=f"--fp8-recipe delayed: the steps whose amaxes choose each scale (default "
                            f"{DELAYED_SCALING_DEFAULTS['fp8_amax_history_len']}, Megatron-LM's)")
    group.add_argument("--fp8-amax-compute-algo", choices=("most_recent", "max"), default=None,
                       help=f"--fp8-recipe delayed: the amax a scale comes from, the newest of the history or its "
                            f"largest (default {DELAYED_SCALING_DEFAULTS['fp8_amax_compute_algo']}, Megatron-LM's)")
    group.add_argument("--fp8-param-gather", action="store_true",
                       help="FP8 parameters gathered in FP8: refused, not built (the weights stay bf16 and are "
                            "quantised at each GEMM)")
    group.add_argument("--first-last-layers-bf16", action="store_true",
                       help="under FP8, keep the first --num-layers-at-start-in-bf16 and the last "
                            "--num-layers-at-end-in-bf16 layers' GEMMs in bf16")
    group.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    group.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def _add_unbuilt_feature_args(parser):
    """Megatron-DeepSpeed flags of features megatron_ds does not build (yet): parsed so that a launch script's
    command line reads, and refused by name (arguments/checks.py) when they ask for the feature."""
    group = parser.add_argument_group("Megatron-DeepSpeed features not built here (refused when used)")
    group.add_argument("--num-experts", type=int, nargs="+", default=[1], help="Mixture of Experts (1: dense)")
    group.add_argument("--mlp-type", choices=["standard", "residual"], default="standard")
    group.add_argument("--topk", type=int, default=1)
    group.add_argument("--expert-interval", type=int, default=2)
    group.add_argument("--moe-expert-parallel-size", type=int, default=1)
    group.add_argument("--moe-train-capacity-factor", type=float, default=1.0)
    group.add_argument("--moe-eval-capacity-factor", type=float, default=1.0)
    group.add_argument("--moe-min-capacity", type=int, default=4)
    group.add_argument("--moe-loss-coeff", type=float, default=0.1)
    group.add_argument("--create-moe-param-group", action="store_true")
    group.add_argument("--disable-moe-token-dropping", dest="moe_token_dropping", action="store_false")
    group.add_argument("--disable-moe-top2-2nd-expert-sampling", dest="moe_top2_2nd_expert_sampling",
                       action="store_false")
    group.add_argument("--enable-expert-tensor-parallelism", action="store_true")
    group.add_argument("--ds-sequence-parallel-size", type=int, default=1, help="DeepSpeed-Ulysses (1: off)")
    group.add_argument("--ds-sequence-parallel-fpdt", action="store_true",
                       help="DeepSpeed's FPDT attention: Ulysses over chunks of the sequence")
    group.add_argument("--ds-sequence-parallel-fpdt-chunk-size", type=int, default=65536,
                       help="FPDT: tokens per chunk (--seq-length must be a multiple)")
    group.add_argument("--ds-sequence-parallel-fpdt-offloading", action="store_true",
                       help="FPDT: the chunks' keys and values kept in host memory (a GPU only)")
    group.add_argument("--universal-checkpoint", action="store_true",
                       help="--load a DeepSpeed universal checkpoint (ds_to_universal's output, named by "
                            "latest_universal in --load) through DeepSpeed's universal loading; without one, "
                            "--load continues our checkpoints at any layout (resharded on load) as always")
    group.add_argument("--mos", action="store_true", help="Mixture-of-Students")
    group.add_argument("--random-ltd", action="store_true")
    group.add_argument("--data-efficiency-curriculum-learning", action="store_true")
    for flag in ("--train-doc-idx-path", "--train-sample-idx-path", "--train-shuffle-idx-path"):
        group.add_argument(flag, default=None)


class _MissingFlags(Exception):
    pass


class _CollectingParser(argparse.ArgumentParser):
    """argparse, but a bad value raises ArgumentError and a missing required flag _MissingFlags instead of
    exiting, so parse_flags can report every problem of a command line at once."""

    def __init__(self, **kwargs):
        super().__init__(exit_on_error=False, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise _MissingFlags(message)


def build_parser(prog="pretrain.py"):
    """The argparse parser of every pretrain.py flag (tools/plan.py extends it)."""
    parser = _CollectingParser(prog=prog, description="Megatron-style GPT pretraining on DeepSpeed")
    for add in (_add_model_args, _add_fusion_args, _add_memory_args, _add_training_args, _add_parallel_args,
                _add_logging_args, _add_data_args, _add_deepspeed_args, _add_checkpoint_args, _add_distillation_args,
                _add_dropless_moe_args, _add_multi_token_prediction_args, _add_fp8_args, _add_unbuilt_feature_args,
                compat.add_arguments):
        add(parser)
    return parser


def parse_flags(parser, argv=None):
    """(flags or None, problems): argparse's result and every unknown flag and bad value of argv (argparse
    alone stops at the first). The occurrence with a bad value is left out and parsing goes on; flags is None
    when required flags are missing."""
    argv = list(sys.argv[1:] if argv is None else argv)
    problems = []
    while True:
        try:
            flags, unknown = parser.parse_known_args(argv)
        except argparse.ArgumentError as error:
            problems.append(str(error))
            shorter = _without_flag(argv, set(error.argument_name.split("/")) if error.argument_name else set())
            if len(shorter) == len(argv):
                return None, problems
            argv = shorter
            continue
        except _MissingFlags as error:
            return None, problems + [str(error)]
        if unknown:
            problems.append(f"unrecognized arguments: {' '.join(unknown)} "
                            f"(python {parser.prog} --help lists the flags)")
        return flags, problems


def _without_flag(argv, option_strings):
    """argv without the last occurrence of a flag (--flag value... or --flag=value): argparse keeps the last
    value of a repeated flag, so a script's override is the one most likely wrong."""
    starts = [i for i, token in enumerate(argv) if token.split("=", 1)[0] in option_strings]
    if not starts:
        return argv
    start = end = starts[-1]
    if "=" not in argv[start]:
        while end + 1 < len(argv) and not argv[end + 1].startswith("--"):
            end += 1
    return argv[:start] + argv[end + 1:]


@functools.lru_cache(maxsize=1)
def flag_defaults():
    """{destination: default} of every flag, e.g. to read a checkpoint saved before a flag existed (read-only;
    built once per process)."""
    return types.MappingProxyType({action.dest: action.default for action in build_parser()._actions
                                   if action.dest != "help"})
