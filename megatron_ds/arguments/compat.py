"""The rest of Megatron-DeepSpeed's megatron/arguments.py (the flags its launch scripts pass are parsed with their
meaning in flags.py): flags that change nothing here, accepted with the reason in --help, and flags that ask for
what megatron_ds does not build, parsed so that a command line reads and refused by name when given
(compat_errors), with what to do instead where there is something. Never "unrecognized arguments"."""
SWITCH, VALUE, LIST = "switch", "value", "list"

NO_EFFECT = {
    "--accumulate-allreduce-grads-in-fp32": (SWITCH, "Megatron's own data-parallel gradient buffers: DeepSpeed's "
                                                     "engine reduces the gradients here"),
    "--no-contiguous-buffers-in-local-ddp": (SWITCH, "Megatron's local DDP: DeepSpeed's engine does the data "
                                                     "parallelism here"),
    "--overlap-p2p-communication": (SWITCH, "Megatron's pipeline sends: DeepSpeed's pipeline engine sends here"),
    "--use-ring-exchange-p2p": (SWITCH, "Megatron's pipeline sends: DeepSpeed's pipeline engine sends here"),
    "--use-cpu-initialization": (SWITCH, "every weight is initialised from a generator seeded by its name: the same "
                                         "values wherever it is made"),
    "--disable-mem-efficient-ln": (SWITCH, "its choice of apex LayerNorm kernel: --fusion-backend picks it here"),
    "--attention-softmax-in-fp32": (SWITCH, "the attention softmax always runs in fp32 here"),
    "--use-tutel": (SWITCH, "Tutel's kernels inside DeepSpeed's MoE: the routing and experts compute the same "
                            "without them"),
    "--ds_fused_adam": (SWITCH, "a fused AdamW runs on GPUs already (apex's or torch's, see --fusion-backend)"),
    "--cpu_torch_adam": (SWITCH, "--cpu-optimizer runs DeepSpeed's CPU Adam: the same AdamW update"),
    "--lazy-mpu-init": (VALUE, "for programs that make the process groups themselves: pretrain.py makes them"),
    "--mmap-warmup": (SWITCH, "its warm-up read of the mapped dataset: the files are mapped on demand here"),
    "--inference-batch-times-seqlen-threshold": (VALUE, "its generation server's pipelining: tools/generate.py "
                                                        "does not pipeline"),
    "--max-tokens-to-oom": (VALUE, "its generation server's limit: tools/generate.py takes --max-new-tokens"),
    "--onnx-safe": (VALUE, "its ONNX export: nothing here exports ONNX"),
    "--tensorboard-log-interval": (VALUE, "TensorBoard scalars are written every --log-interval here"),
    "--no-barrier-with-level-1-timing": (SWITCH, "the timers here take no barrier at any level"),
    "--zero-reduce-scatter": (SWITCH, "the DeepSpeed JSON's zero_optimization block sets it"),
    "--zero-contigious-gradients": (SWITCH, "the DeepSpeed JSON's zero_optimization block sets it"),
    "--zero-reduce-bucket-size": (VALUE, "the DeepSpeed JSON's zero_optimization block sets it"),
    "--zero-allgather-bucket-size": (VALUE, "the DeepSpeed JSON's zero_optimization block sets it"),
    "--fp8-interval": (VALUE, "Transformer Engine's scale update interval, which Megatron-LM ignores too: FP8 "
                              "scales are computed at every GEMM here (--fp8-format)"),
}

# flag -> (kind, what it asks for, what to do instead); a value flag with accepted values lists them
NOT_BUILT = {
    "--apply-layernorm-1p": (SWITCH, "LayerNorm with a 1 + weight scale", "train with plain LayerNorm or RMSNorm"),
    "--apply-residual-connection-post-layernorm": (SWITCH, "residual connections after the norm", "drop the flag"),
    "--openai-gelu": (SWITCH, "OpenAI's tanh GeLU", "drop the flag (erf GeLU)"),
    "--squared-relu": (SWITCH, "squared ReLU MLPs", "drop the flag"),
    "--fp32-residual-connection": (SWITCH, "fp32 residual streams under fp16/bf16", "drop the flag"),
    "--fp16-lm-cross-entropy": (SWITCH, "cross entropy in fp16", "drop the flag (it runs in fp32)"),
    "--init-method-xavier-uniform": (SWITCH, "Xavier-uniform initialisation", "use --init-method-std"),
    "--no-position-embedding": (SWITCH, "its switch for no learned positions", "pass --position-embedding-type "
                                                                               "none (or rope)"),
    "--data-parallel-random-init": (SWITCH, "different initial weights per data-parallel rank", "drop the flag"),
    "--use-checkpoint-args": (SWITCH, "the model's flags taken from --load's checkpoint", "pass the model flags "
                                                                                         "(--load checks them)"),
    "--no-save-optim": (SWITCH, "checkpoints without optimizer states", "convert one with "
                                                                        "tools/convert_checkpoint.py --no-optim"),
    "--no-save-rng": (SWITCH, "checkpoints without RNG states", "load with --no-load-rng"),
    "--no-initialization": (SWITCH, "skipping initialisation before a load", "drop the flag"),
    "--start-weight-decay": (VALUE, "a weight-decay schedule", "use --weight-decay"),
    "--end-weight-decay": (VALUE, "a weight-decay schedule", "use --weight-decay"),
    "--weight-decay-incr-style": (VALUE, "a weight-decay schedule", "use --weight-decay", ("constant",)),
    "--use-distributed-optimizer": (SWITCH, "Megatron's distributed optimizer", "--zero-stage 1 (the default) "
                                                                                "shards the optimizer states"),
    "--standalone-embedding-stage": (SWITCH, "a pipeline stage holding only the embedding", "drop the flag"),
    "--force-ds-sequence-parallel": (SWITCH, "DeepSpeed-Ulysses' code path at size 1",
                                     "use --ds-sequence-parallel-size"),
    "--ds-inference": (SWITCH, "DeepSpeed inference", "use tools/generate.py"),
    "--inference": (SWITCH, "inference without an optimizer", "use tools/generate.py"),
    "--skip-train": (SWITCH, "evaluation without training", "drop the flag"),
    "--empty-unused-memory-level": (VALUE, "emptying the CUDA cache during training", "drop the flag", ("0",)),
    "--dataloader-type": (VALUE, "its cyclic data loader", "drop the flag (the samples are read in order, its "
                                                           "'single')", ("single",)),
    "--timing-log-option": (VALUE, "timers printed other than as (min, max)", "drop the flag", ("minmax",)),
    "--model-parallel-size": (VALUE, "its removed spelling", "use --tensor-model-parallel-size"),
    "--batch-size": (VALUE, "its removed spelling", "use --micro-batch-size"),
    "--warmup": (VALUE, "its removed spelling", "use --lr-warmup-fraction or --lr-warmup-iters"),
    "--adlr-autoresume": (SWITCH, "NVIDIA's ADLR auto-resume", "use torchrun --max-restarts or tools/supervise.py"),
    "--adlr-autoresume-interval": (VALUE, "NVIDIA's ADLR auto-resume", "use torchrun --max-restarts or "
                                                                       "tools/supervise.py"),
    "--aml-data-download-path": (VALUE, "Azure ML's data download", "give --data-path local files"),
    "--trust-remote-code": (SWITCH, "Hugging Face tokenizers with remote code", "use a local tokenizer"),
    "--use-dataset-only": (VALUE, "building the datasets alone", "use tools/preprocess_data.py"),
    "--return-data-index": (SWITCH, "sample indices in the batches", "drop the flag"),
    "--repeated-dataloader": (SWITCH, "its repeating data loader", "drop the flag"),
    "--train-data-exact-num-epochs": (VALUE, "exact epochs of the training data", "use --train-samples"),
    "--train-idx-path": (VALUE, "index files given by path", "megatron_ds builds and caches its own "
                                                             "(--data-cache-path)"),
    "--train-desc-path": (VALUE, "index files given by path", "megatron_ds builds and caches its own "
                                                              "(--data-cache-path)"),
    "--remote-device": (VALUE, "ZeRO-3's zero.Init placing parameters at construction",
                        "use the DeepSpeed JSON's offload_param block", ("none",)),
    "--use-pin-memory": (SWITCH, "ZeRO-3's zero.Init pinned memory", "use the DeepSpeed JSON's offload blocks"),
    "--scattered-embeddings": (SWITCH, "its ZeRO-3 memory-centric layouts", "drop the flag"),
    "--split-transformers": (SWITCH, "its ZeRO-3 memory-centric layouts", "drop the flag"),
    "--memory-centric-tiled-linear": (SWITCH, "its ZeRO-3 memory-centric tiling", "drop the flag"),
    "--tile-factor": (VALUE, "its ZeRO-3 memory-centric tiling", "drop the flag", ("1",)),
    "--num-experts-switch": (VALUE, "its Switch-style expert count", "use --num-experts"),
    "--no-log-learnig-rate-to-tensorboard": (SWITCH, "dropping the learning rate from TensorBoard",
                                             "drop the flag"),
    "--no-log-loss-scale-to-tensorboard": (SWITCH, "dropping the loss scale from TensorBoard", "drop the flag"),
    "--transformer-impl": (VALUE, "Transformer Engine's layer implementation",
                           "drop the flag (megatron_ds's own layers run; FP8 with --fp8-format)", ("local",)),
    "--no-fp8-wgrad": (SWITCH, "FP8 training with high-precision weight-gradient GEMMs", "drop the flag (with "
                                                                                        "--fp8-format all three GEMMs "
                                                                                        "of a linear run in FP8)"),
}

# its other models' flags: refused by the model family they belong to
OTHER_MODELS = {
    "RETRO (retrieval-augmented) models": (
        "--retro-workdir", "--retro-add-retriever", "--retro-cyclic-train-iters", "--retro-encoder-layers",
        "--retro-encoder-hidden-dropout", "--retro-encoder-attention-dropout", "--retro-num-neighbors",
        "--retro-num-retrieved-chunks", "--retro-return-doc-ids", "--retriever-seq-length"),
    "BERT, T5 and the retriever models (ICT, REALM, biencoder)": (
        "--output-bert-embeddings", "--bert-embedder-type", "--bert-no-binary-head", "--encoder-num-layers",
        "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length", "--vocab-extra-ids",
        "--pipeline-model-parallel-split-rank", "--mask-prob", "--short-seq-prob", "--sample-rate", "--ict-head-size",
        "--biencoder-projection-dim", "--biencoder-shared-query-context-model", "--ict-load", "--bert-load",
        "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path",
        "--retriever-report-topk-accuracies", "--retriever-score-scaling", "--block-data-path", "--embedding-path",
        "--indexer-batch-size", "--indexer-log-interval"),
    "vision models (ViT, Swin, DINO)": (
        "--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim", "--classes-fraction",
        "--data-per-class-fraction", "--no-data-sharding", "--head-lr-mult", "--vision-pretraining",
        "--vision-pretraining-type", "--vision-backbone-type", "--swin-backbone-type", "--mask-type", "--mask-factor",
        "--iter-per-epoch", "--dino-local-img-size", "--dino-local-crops-number", "--dino-head-hidden-size",
        "--dino-bottleneck-size", "--dino-freeze-last-layer", "--dino-norm-last-layer", "--dino-warmup-teacher-temp",
        "--dino-teacher-temp", "--dino-warmup-teacher-temp-epochs"),
}
# how those take a value: the switches and the one list (the others take one value)
_OTHER_MODEL_KINDS = {
    **{flag: SWITCH for flag in (
        "--retro-add-retriever", "--retro-return-doc-ids",
        "--output-bert-embeddings", "--bert-no-binary-head", "--biencoder-shared-query-context-model",
        "--use-one-sent-docs", "--retriever-score-scaling", "--no-data-sharding", "--vision-pretraining",
        "--dino-norm-last-layer")},
    "--retriever-report-topk-accuracies": LIST}


def _dest(flag):
    return "megatron_deepspeed_" + flag.lstrip("-").replace("-", "_")


def _add(group, flag, kind, help_text):
    if kind == SWITCH:
        group.add_argument(flag, dest=_dest(flag), action="store_true", help=help_text)
    else:
        group.add_argument(flag, dest=_dest(flag), default=None, nargs="+" if kind == LIST else None, metavar="VALUE",
                           help=help_text)


def add_arguments(parser):
    accepted = parser.add_argument_group("Megatron-DeepSpeed flags that change nothing here (accepted)")
    for flag, (kind, reason) in NO_EFFECT.items():
        _add(accepted, flag, kind, f"accepted: {reason}")
    refused = parser.add_argument_group("Megatron-DeepSpeed flags of what megatron_ds does not build (refused when "
                                        "given)")
    for flag, (kind, feature, instead, *allowed) in NOT_BUILT.items():
        _add(refused, flag, kind, f"{feature}: not built; {instead}" + (f" (accepted: {', '.join(allowed[0])})"
                                                                         if allowed else ""))
    for family, flags in OTHER_MODELS.items():
        for flag in flags:
            _add(refused, flag, _OTHER_MODEL_KINDS.get(flag, VALUE), f"for its {family}")


def compat_errors(args):
    """Each Megatron-DeepSpeed flag given that asks for what is not built here, named with what to do instead."""
    errors = []
    for flag, (_, feature, instead, *allowed) in NOT_BUILT.items():
        value = getattr(args, _dest(flag), None)
        if value in (None, False) or (allowed and str(value) in allowed[0]):
            continue
        shown = flag if value is True else f"{flag} {value}"
        errors.append(f"{shown}: {feature} is not built in megatron_ds; {instead}")
    for family, flags in OTHER_MODELS.items():
        errors += [f"{flag}: a flag of Megatron-DeepSpeed's {family}, which megatron_ds does not train (GPT and LLaMA "
                   f"models)" for flag in flags if getattr(args, _dest(flag), None) not in (None, False)]
    return errors
