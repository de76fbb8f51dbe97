"""What tools/convert_checkpoint.py does: reshape a checkpoint to another (TP, PP), export it to Hugging
Face, import Hugging Face weights, convert Megatron-DeepSpeed's checkpoints to ours and ours to its format. Runs in
one process on CPU; the whole model is held in memory."""
import json
import os
import shutil

import torch

from megatron_ds.arguments import flag_defaults, padded_vocab_size
from megatron_ds.checkpointing import discovery, files, layout, state
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.conversion import huggingface
from megatron_ds.core.parallel_layout import stages_without_experts
from megatron_ds.core.pipeline_split import (
    LAYOUT_FLAG,
    PipelineSplit,
    first_layers,
    split_flags,
    split_from_flags,
)
from megatron_ds.core.transformer.transformer_config import MLA_FIELDS
from megatron_ds.data.tokenizers import build_tokenizer

MTP_FILE = "model-mtp.safetensors"  # an export's multi-token prediction modules, which transformers does not hold


def _log(message):
    print(f"convert_checkpoint: {message}", flush=True)


def load_full(load_dir, iteration=None, with_optimizer=True):
    """(FullState, checkpoint folder) of the checkpoint --load [--load-iteration] names."""
    tag, metadata, notes = discovery.resolve_checkpoint(load_dir, iteration)
    for note in notes:
        _log(f"note: {note}")
    if tag is None:
        raise CheckpointError(f"--load {load_dir}: no checkpoint there")
    path = os.path.join(load_dir, tag)
    with_optimizer = with_optimizer and metadata.get("has_optimizer_states", False)
    full = state.read_full_state(path, metadata, with_optimizer=with_optimizer)
    return full, path


def _check_target(shape, tp, pp, ep=None, expert_tensor_parallelism=None, split=PipelineSplit()):
    """shape: the model's (files.model_shape). Returns the layers of each target pipeline stage (one model stage
    per pipeline rank, as 1F1B places them)."""
    stage_layers, problems = _target_stage_layers(shape, pp, split)
    problems += _expert_layout_problems(shape, pp, ep, expert_tensor_parallelism, stage_layers, split)
    if files.is_dropless_moe(shape) and expert_tensor_parallelism == "on":
        problems += _dropless_expert_tensor_parallel_problems(shape, tp)
    for what, value in (("--num-attention-heads", shape["num_attention_heads"]),
                        ("--num-key-value-heads", shape["num_key_value_heads"]),
                        ("--ffn-hidden-size", shape["ffn_hidden_size"])):
        if value % tp:
            problems.append(f"{what} {value} is not divisible by --target-tensor-parallel-size {tp}")
    if tp < 1 or pp < 1:
        problems.append("target sizes must be positive")
    if problems:
        raise CheckpointError("cannot reshape to this layout:\n  - " + "\n  - ".join(problems))
    return stage_layers


def _target_stage_layers(shape, pp, split):
    """(the layers of each target pipeline stage, or None; the split's problems)."""
    num_layers = shape["num_layers"]
    if pp < 1:
        return None, []  # _check_target refuses it
    if split.is_even:
        if num_layers % pp:
            return None, [f"--num-layers {num_layers} is not divisible by --target-pipeline-model-parallel-size {pp}"]
        return split.stage_layers(num_layers, pp), []
    problems = [problem.replace("--pipeline-model-parallel-size", "--target-pipeline-model-parallel-size")
                for problem in split.problems(num_layers, pp)]
    modules = shape.get("mtp_num_layers") or 0
    placed = "".join(split.layout).count("m") if split.layout is not None else modules
    if placed != modules:
        problems.append(f"{LAYOUT_FLAG} places {placed} multi-token prediction module(s) (m), the model has "
                        f"{modules} (--mtp-num-layers)")
    return (None, problems) if problems else (split.stage_layers(num_layers, pp), [])


def _expert_layout_problems(shape, pp, ep, expert_tensor_parallelism, stage_layers, split):
    if not files.is_moe(shape):
        return ([f"--target-expert-parallel-size {ep}: the model has no experts"] if ep not in (None, 1) else []) + \
            ([f"--target-expert-tensor-parallelism {expert_tensor_parallelism}: the model has no experts"]
             if expert_tensor_parallelism else [])
    problems = [f"--num-experts {count} is not divisible by --target-expert-parallel-size {ep}"
                for count in sorted(set(shape["num_experts"])) if ep and count % ep]
    if stage_layers is None:
        return problems
    if files.is_dropless_moe(shape):
        pattern, starts = shape["dropless_moe_layers"], first_layers(stage_layers)
        empty = [stage for stage in range(pp) if not any(pattern[starts[stage]:starts[stage + 1]])]
        placement = f"--moe-layer-freq {pattern}"
    else:
        empty = stages_without_experts(shape["num_layers"], pp, shape["expert_interval"], split)
        placement = f"--expert-interval {shape['expert_interval']}"
    if empty:
        problems.append(f"pipeline stage(s) {empty} of --target-pipeline-model-parallel-size {pp}"
                        f"{' ' + split.describe() if not split.is_even else ''} would hold no MoE layer ({placement})")
    return problems


def _dropless_expert_tensor_parallel_problems(shape, tp):
    """--target-expert-tensor-parallelism on for the dropless layer: its experts split over the TP ranks
    (--expert-tensor-parallel-size = TP), each expert's FFN size divisible by TP."""
    if tp == 1:
        return ["--target-expert-tensor-parallelism on: --target-tensor-parallel-size 1 has no TP ranks to split the "
                "experts over"]
    ffn = shape["moe_ffn_hidden_size"] or shape["ffn_hidden_size"]
    return [f"--target-expert-tensor-parallelism on: each expert's FFN size {ffn} (--moe-ffn-hidden-size) is not "
            f"divisible by --target-tensor-parallel-size {tp}"] if ffn % tp else []


def _retarget(full, tp, pp, divisible_by=None, split=PipelineSplit()):
    """Set the layout in full.args; keep the vocabulary rows when they split over tp, else pad them."""
    args = full.args
    rows = full.weights[layout.WORD_EMBEDDINGS].size(0)
    if divisible_by is not None:
        wanted = padded_vocab_size(args["vocab_size"], divisible_by, tp)
    elif rows % tp == 0:
        wanted, divisible_by = rows, rows // tp
    else:
        wanted = -(-rows // tp) * tp
        divisible_by = wanted // tp
    if wanted != rows:
        _log(f"vocabulary rows {rows} -> {wanted} (zero rows added or padding rows dropped: the softmax over the "
             f"padded vocabulary changes slightly)")
        state.resize_vocabulary(full, wanted)
    old_dp = args.get("data_parallel_size") or 1
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, padded_vocab_size=wanted,
                make_vocab_size_divisible_by=divisible_by, world_size=tp * pp * old_dp)
    args.update(split_flags(split))  # the target's split, as pretrain.py's flags give it
    return divisible_by


def _training_hint(full, tp, pp, expert_tp=None):
    """The flags to train the written checkpoint with; expert_tp: the dropless layer's expert TP size to print."""
    args = full.args
    split = split_from_flags(args).describe()
    hint = (f"train it with --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
            f"{' ' + split if split else ''} --make-vocab-size-divisible-by {args['make_vocab_size_divisible_by']}")
    if not files.is_moe(full.model):
        return hint + " (any data-parallel size)"
    if args.get("enable_expert_tensor_parallelism"):
        hint += " --enable-expert-tensor-parallelism"
    if expert_tp is not None:
        hint += f" --expert-tensor-parallel-size {expert_tp}"
    return (hint + f" {_expert_parallel_flag(full.model, args)} (each file holds every expert: any data-parallel "
            f"size and any expert-parallel size that divides the experts and the data-parallel size)")


def _expert_parallel_flag(shape, args):
    """The flag of the expert-parallel size recorded for an MoE model, in its MoE layer's family."""
    if files.is_dropless_moe(shape):
        return f"--expert-model-parallel-size {args.get('expert_model_parallel_size') or 1}"
    return f"--moe-expert-parallel-size {args.get('moe_expert_parallel_size') or 1}"


def _set_expert_layout(args, ep, expert_tensor_parallelism, tp):
    """Record the expert-parallel size the checkpoint is meant for (the files hold every expert either way), and
    whether its experts are split over TP ("on") or whole ("off"; None: as they are). DeepSpeed-MoE's split experts
    are split in the files; the dropless layer's are written whole (expert TP 1 in the saved flags, which the reader
    goes by), and any expert TP loads them: returns the expert TP size to train them with (None: no dropless
    layer)."""
    if ep is not None:
        args["moe_expert_parallel_size"] = ep
        if args.get("dropless_moe"):  # Megatron-Core's flag of the same size
            args["expert_model_parallel_size"] = ep
    if not args.get("dropless_moe"):
        if expert_tensor_parallelism is not None:
            args["enable_expert_tensor_parallelism"] = expert_tensor_parallelism == "on"
        return None
    split = (args.get("expert_tensor_parallel_size") or 1) > 1 if expert_tensor_parallelism is None else \
        expert_tensor_parallelism == "on"
    args["expert_tensor_parallel_size"] = 1
    return tp if split and tp > 1 else 1


def reshape(load_dir, save_dir, tp, pp, iteration=None, with_optimizer=True, ep=None, expert_tensor_parallelism=None,
            split=PipelineSplit()):
    full, path = load_full(load_dir, iteration, with_optimizer)
    stage_layers = _check_target(full.model, tp, pp, ep, expert_tensor_parallelism, split)
    source = (full.args["tensor_model_parallel_size"], full.args["pipeline_model_parallel_size"],
              full.args.get("moe_expert_parallel_size") or 1)
    expert_tp = _set_expert_layout(full.args, ep, expert_tensor_parallelism, tp)
    _retarget(full, tp, pp, split=split)
    folder = state.write_sharded_checkpoint(full, save_dir, tp, pp, with_optimizer=with_optimizer, source=path,
                                            stage_layers=stage_layers)
    experts = files.is_moe(full.model)
    source_text = f"TP {source[0]} x PP {source[1]}" + (f" x EP {source[2]}" if experts else "")
    target_text = f"TP {tp} x PP {pp}" + (f" x EP {full.args.get('moe_expert_parallel_size') or 1}" if experts else "")
    _log(f"reshaped {path} ({source_text}) to {folder} ({target_text}), iteration "
         f"{full.iteration}, {'with' if full.optimizer is not None else 'without'} optimizer states; "
         + _training_hint(full, tp, pp, expert_tp))
    return folder


# --- Hugging Face -------------------------------------------------------------------------------------

def to_hf(load_dir, hf_dir, iteration=None, trim_vocab_padding=False):
    from transformers import AutoModelForCausalLM
    full, path = load_full(load_dir, iteration, with_optimizer=False)
    args = full.args
    if files.is_dropless_moe(full.model) and args.get("moe_expert_capacity_factor") is not None:
        _log(f"note: the model was run with --moe-expert-capacity-factor {args['moe_expert_capacity_factor']:g} "
             f"(experts over capacity drop tokens); the Hugging Face model drops none")
    rows = args["vocab_size"] if trim_vocab_padding else full.weights[layout.WORD_EMBEDDINGS].size(0)
    config, hf_state = huggingface.to_hf_state(full.model, args, full.weights, rows)
    outside = {name: hf_state.pop(name) for name in huggingface.mtp_layer_names(config, list(hf_state))}
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    missing = [name for name in missing if name != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise CheckpointError(f"Hugging Face state mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    os.makedirs(hf_dir, exist_ok=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
    if outside:
        _save_beside_transformers(hf_dir, outside)
    with open(os.path.join(hf_dir, huggingface.SIDECAR_FILE), "w") as handle:
        json.dump({"args": args, "iteration": full.iteration, "source": path}, handle, indent=1, sort_keys=True)
    tokenizer = _copy_tokenizer_to_hf(args, hf_dir)
    _log(f"wrote {type(model).__name__} ({rows} vocabulary rows, safetensors) to {hf_dir} from {path}"
         + (f"; tokenizer: {tokenizer}" if tokenizer else "; no tokenizer (NullTokenizer run)"))
    return hf_dir


def _save_beside_transformers(hf_dir, tensors, file_name=MTP_FILE):
    """Tensors the transformers model does not hold (DeepSeek-V3's MTP modules) in a safetensors file of their own,
    entered in the folder's weight index where save_pretrained wrote one (several shards)."""
    from safetensors.torch import save_file
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, os.path.join(hf_dir, file_name),
              metadata={"format": "pt"})
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as handle:
            index = json.load(handle)
        index["weight_map"].update({name: file_name for name in tensors})
        with open(index_path, "w") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)


def _copy_tokenizer_to_hf(args, hf_dir):
    kind = args.get("tokenizer_type")
    eos = None
    if kind == "HuggingFaceTokenizer":
        source = args["tokenizer_model"]
        folder = source if os.path.isdir(source) else os.path.dirname(source)
        tokenizer_json = source if os.path.isfile(source) else os.path.join(source, "tokenizer.json")
        shutil.copyfile(tokenizer_json, os.path.join(hf_dir, "tokenizer.json"))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(hf_dir, name))
        if not os.path.isfile(os.path.join(hf_dir, "tokenizer_config.json")):
            from tokenizers import Tokenizer
            eos = Tokenizer.from_file(tokenizer_json).id_to_token(args["eod"])
            _write_tokenizer_config(hf_dir, "PreTrainedTokenizerFast", eos)
        return "tokenizer.json"
    if kind == "GPT2BPETokenizer":
        shutil.copyfile(args["vocab_file"], os.path.join(hf_dir, "vocab.json"))
        shutil.copyfile(args["merge_file"], os.path.join(hf_dir, "merges.txt"))
        _write_tokenizer_config(hf_dir, "GPT2Tokenizer", "<|endoftext|>")
        return "vocab.json + merges.txt"
    if kind == "SentencePieceTokenizer":
        shutil.copyfile(args["tokenizer_model"], os.path.join(hf_dir, "tokenizer.model"))
        _write_tokenizer_config(hf_dir, "LlamaTokenizer", "</s>")
        return "tokenizer.model (SentencePiece)"
    return None


def _write_tokenizer_config(hf_dir, tokenizer_class, eos):
    config = {"tokenizer_class": tokenizer_class, "eos_token": eos, "bos_token": eos, "unk_token": eos,
              "model_max_length": 1 << 30}
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as handle:
        json.dump(config, handle, indent=1)


def read_hf(hf_dir, divisible_by=None, tp=1, moe_layer=None):
    """FullState (iteration 0, no optimizer) of a Hugging Face model folder, for TP `tp`; the experts in the MoE
    layer `moe_layer` (huggingface.MOE_LAYERS; None: the model's, see huggingface.from_hf_state)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(hf_dir)
    model = _load_hf_model(hf_dir)
    if config.model_type == "gpt2" and config.activation_function != "gelu":
        _log(f"note: the HF model uses activation_function {config.activation_function!r} (tanh approximation); "
             f"megatron_ds's GeLU is exact (erf): outputs differ slightly")
    hf_state = {**model.state_dict(), **_tensors_transformers_skips(hf_dir, config)}
    model_args, weights = huggingface.from_hf_state(config, hf_state, moe_layer)
    sidecar = os.path.join(hf_dir, huggingface.SIDECAR_FILE)
    base = json.load(open(sidecar))["args"] if os.path.isfile(sidecar) else {}
    args = {**_default_args(), **base, **model_args}
    args.update(_hf_tokenizer_args(hf_dir, base))
    hf_rows = weights[layout.WORD_EMBEDDINGS].size(0)
    args["vocab_size"] = base.get("vocab_size") or args.get("vocab_size") or hf_rows
    if args["tokenizer_type"] == "NullTokenizer":
        args["vocab_size"] = base.get("vocab_size") or hf_rows
    args["eod"] = base.get("eod", config.eos_token_id if isinstance(config.eos_token_id, int) else None)
    if args["tokenizer_type"] != "NullTokenizer":  # the tokenizer's own end-of-document id
        try:
            args["eod"] = build_tokenizer(args["tokenizer_type"], tokenizer_model=args.get("tokenizer_model"),
                                          vocab_file=args.get("vocab_file"), merge_file=args.get("merge_file")).eod
        except ValueError as error:
            _log(f"note: the tokenizer files in {hf_dir} do not load ({error}); end-of-document id from config.json")
    full = state.FullState(args=args, weights=weights)
    divisible_by = divisible_by or base.get("make_vocab_size_divisible_by") or \
        flag_defaults()["make_vocab_size_divisible_by"]
    wanted = padded_vocab_size(max(args["vocab_size"], 1), divisible_by, tp)
    if wanted < hf_rows:  # HF rows beyond our padding: grow the padding to keep them
        wanted = -(-hf_rows // (divisible_by * tp)) * divisible_by * tp
    if wanted != hf_rows:
        state.resize_vocabulary(full, wanted)
    args.update(padded_vocab_size=wanted, make_vocab_size_divisible_by=divisible_by)
    return full


def _tensors_transformers_skips(hf_dir, config):
    """The tensors of the folder's safetensors files that the transformers model does not load and the conversion
    reads (DeepSeek-V3's multi-token prediction modules: huggingface.mtp_layer_names)."""
    from safetensors import safe_open
    tensors = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "pt") as handle:
                for key in huggingface.mtp_layer_names(config, handle.keys()):
                    tensors[key] = handle.get_tensor(key).float()
    return tensors


def _load_hf_model(hf_dir):
    """The model of an HF folder in fp32; one that does not load is a CheckpointError naming the damaged file."""
    from transformers import AutoModelForCausalLM
    try:
        try:
            return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            return AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    except Exception as error:  # safetensors, torch and transformers each raise their own
        raise CheckpointError(f"--from-hf {hf_dir}: {_damaged_weight_file(hf_dir) or 'the model does not load'}: "
                              f"{type(error).__name__}: {error}") from None


def _damaged_weight_file(hf_dir):
    """'FILE is damaged' for the first safetensors file of the folder that does not open, else None."""
    from safetensors import safe_open
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(hf_dir, name), "pt") as handle:
                    for key in handle.keys():
                        handle.get_slice(key)
            except Exception:
                return f"{os.path.join(hf_dir, name)} is damaged (truncated or not safetensors)"
    return None


def _default_args():
    """What a checkpoint made from Hugging Face weights records where the HF folder says nothing."""
    defaults = flag_defaults()
    return {**{name: defaults[name] for name in ("tokenizer_model", "vocab_file", "merge_file", "rotary_base",
                                                 "rotary_percent", "norm_epsilon")},
            "tokenizer_type": "NullTokenizer", "params_dtype": "float32", "data_parallel_size": 1}


def _hf_tokenizer_args(hf_dir, base):
    """Tokenizer flags for the files in the HF folder (kept there: pass them to pretrain.py)."""
    hf_dir = os.path.abspath(hf_dir)
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf_dir}
    if os.path.isfile(os.path.join(hf_dir, "vocab.json")) and os.path.isfile(os.path.join(hf_dir, "merges.txt")):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(hf_dir, "vocab.json"),
                "merge_file": os.path.join(hf_dir, "merges.txt")}
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": os.path.join(hf_dir, "tokenizer.model")}
    return {key: base[key] for key in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file") if key in base}


def from_hf(hf_dir, save_dir, tp, pp, divisible_by=None, ep=None, expert_tensor_parallelism=None,
            moe_layer=None, split=PipelineSplit()):
    full = read_hf(hf_dir, divisible_by, tp, moe_layer)
    stage_layers = _check_target(full.model, tp, pp, ep, expert_tensor_parallelism, split)
    expert_tp = _set_expert_layout(full.args, ep, expert_tensor_parallelism, tp)
    full.args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp,
                     **split_flags(split))
    folder = state.write_sharded_checkpoint(full, save_dir, tp, pp, tag=files.RELEASE_TAG, with_optimizer=False,
                                            source=os.path.abspath(hf_dir), stage_layers=stage_layers)
    shape = full.model
    experts = files.is_moe(shape)
    moe_layer_text = "the dropless MoE layer" if files.is_dropless_moe(shape) else "DeepSpeed-MoE"
    layout_text = f"TP {tp} x PP {pp}" + (f" x EP {ep or 1}, {shape['num_experts'][0]} experts per layer in "
                                          f"{moe_layer_text}" if experts else "")
    _log(f"wrote {folder} ({files.model_family(shape)} family, {layout_text}, weights only) from {hf_dir}; "
         f"fine-tune it with pretrain.py --load {save_dir} --finetune and the model flags "
         f"{model_flags(shape, full.args)} --make-vocab-size-divisible-by {full.args['make_vocab_size_divisible_by']}"
         + (f" {_expert_parallel_flag(shape, full.args)}" if experts else "")
         + (f" --expert-tensor-parallel-size {expert_tp}" if expert_tp is not None else ""))
    return folder


def from_megatron_deepspeed(mds_dir, save_dir, tp=None, pp=None, iteration=None, split=PipelineSplit()):
    """A Megatron-DeepSpeed checkpoint written as ours (weights, fp32 master weights and Adam moments, iteration,
    data position, tokens, LR schedule), at its own layout unless told another."""
    path = megatron_deepspeed.checkpoint_folder(mds_dir, iteration)
    metadata = megatron_deepspeed.read_metadata(path)
    full = state.read_full_state(path, metadata, with_optimizer=metadata["has_optimizer_states"])
    source_tp, source_pp = full.args["tensor_model_parallel_size"], full.args["pipeline_model_parallel_size"]
    tp, pp = tp or source_tp, pp or source_pp
    stage_layers = _check_target(full.model, tp, pp, split=split)
    _retarget(full, tp, pp, split=split)
    folder = state.write_sharded_checkpoint(full, save_dir, tp, pp, with_optimizer=full.optimizer is not None,
                                            source=os.path.abspath(path), stage_layers=stage_layers)
    optimizer = (f"fp32 master weights and Adam moments (step {full.optimizer_step})" if full.optimizer is not None
                 else "no optimizer states (no ZeRO files, or saved before the first step: the optimizer starts "
                      "afresh)")
    schedule = "its LR schedule" if full.scheduler else "no LR schedule (the flags' is used)"
    _log(f"wrote {folder} (iteration {full.iteration}, {full.consumed_train_samples} samples consumed; weights, "
         f"{optimizer}, {schedule}) from Megatron-DeepSpeed's {path} (TP {source_tp} x PP {source_pp}); "
         f"{_training_hint(full, tp, pp)}")
    return folder


def to_megatron_deepspeed(load_dir, save_dir, tp=None, pp=None, dp=None, iteration=None, with_optimizer=True):
    """One of our checkpoints (any of our layouts) written in Megatron-DeepSpeed's format, version 3.0 (weights, fp32
    master weights and Adam moments in its ZeRO-1 files over dp ranks, iteration, data position, tokens, LR
    schedule), at its own TP x PP x DP unless told another."""
    full, path = load_full(load_dir, iteration, with_optimizer)
    source_tp, source_pp = full.args["tensor_model_parallel_size"], full.args["pipeline_model_parallel_size"]
    tp, pp = tp or source_tp, pp or source_pp
    dp = dp or full.args.get("data_parallel_size") or 1
    _check_target(full.model, tp, pp)
    _retarget(full, tp, pp)
    fp8_state = [name for name in full.weights if layout.is_fp8_scaling_state(name)]
    for name in fp8_state:  # its format has no place for them
        del full.weights[name]
    folder = megatron_deepspeed.write_checkpoint(full, save_dir, tp, pp, dp, with_optimizer)
    optimizer = (f"fp32 master weights and Adam moments (step {full.optimizer_step}) in ZeRO-1 files over DP {dp}"
                 if full.optimizer is not None and with_optimizer else "no optimizer states")
    schedule = "the LR schedule" if full.scheduler else "no LR schedule"
    _log(f"wrote Megatron-DeepSpeed's {folder} (checkpoint version {megatron_deepspeed.VERSION_WRITTEN}, TP {tp} x PP "
         f"{pp} x DP {dp}; iteration {full.iteration}, {full.consumed_train_samples} samples consumed; weights, "
         f"{optimizer}, {schedule}) from {path} (TP {source_tp} x PP {source_pp}); in Megatron-DeepSpeed load it "
         f"with --load {save_dir} --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
         f"--make-vocab-size-divisible-by {full.args['make_vocab_size_divisible_by']} on {tp * pp * dp} ranks and "
         f"--no-load-rng (no RNG states are carried)"
         + (f"; FP8 delayed scaling's amax histories and scales ({len(fp8_state)} tensors) are not carried: a run "
            f"loading it back starts them fresh" if fp8_state else ""))
    return folder


def model_flags(shape, args):
    """The pretrain.py model flags that describe a model: its shape (files.model_shape) and its saved arguments
    (for the values outside the shape: the RoPE base, the norm's epsilon, the routing)."""
    flags = [f"--num-layers {shape['num_layers']}", f"--hidden-size {shape['hidden_size']}",
             f"--num-attention-heads {shape['num_attention_heads']}",
             f"--num-key-value-heads {shape['num_key_value_heads']}", f"--ffn-hidden-size {shape['ffn_hidden_size']}"]
    if shape["kv_channels"] * shape["num_attention_heads"] != shape["hidden_size"]:
        flags.append(f"--kv-channels {shape['kv_channels']}")
    if shape["position_embedding_type"] == "learned_absolute":
        flags.append(f"--max-position-embeddings {shape['max_position_embeddings']}")
    if shape["normalization"] == "RMSNorm":
        flags.append("--normalization RMSNorm")
    if shape["swiglu"]:
        flags.append("--swiglu")
    if shape["position_embedding_type"] == "rope":
        rotary_base = args.get("rotary_base", flag_defaults()["rotary_base"])
        flags.append(f"--use-rotary-position-embeddings --rotary-base {rotary_base:g}")
        if shape["rotary_percent"] != 1.0:
            flags.append(f"--rotary-percent {shape['rotary_percent']:g}")
        if shape.get("rope_scaling"):
            flags.append(rope_scaling_flags(shape["rope_scaling"]))
    if not shape["bias"]:
        flags.append("--disable-bias-linear")
    if shape.get("add_qkv_bias"):
        flags.append("--add-qkv-bias")
    if shape.get("qk_layernorm"):
        flags.append("--qk-layernorm")
    if shape.get("multi_latent_attention"):
        flags.append("--multi-latent-attention " + " ".join(
            f"--{name.replace('_', '-')} {shape[name]}" for name in MLA_FIELDS[1:] if shape[name] is not None))
    if not shape["tied_embeddings"]:
        flags.append("--untie-embeddings-and-output-weights")
    if shape.get("mtp_num_layers"):
        flags.append(f"--mtp-num-layers {shape['mtp_num_layers']}")
    flags.append(f"--norm-epsilon {args.get('norm_epsilon', flag_defaults()['norm_epsilon']):g}")
    if files.is_dropless_moe(shape):
        flags.append(dropless_moe_flags(shape, args))
    elif files.is_moe(shape):
        flags.append(moe_flags(shape, args))
    return " ".join(flags)


def rope_scaling_flags(scaling):
    """The pretrain.py flags of a RoPE scaling (files.model_shape's rope_scaling), every value exact."""
    if scaling["type"] == "llama3":
        return f"--use-rope-scaling --rope-scaling-factor {_exact(scaling['factor'])}"
    return " ".join([f"--rope-type yarn --rotary-scaling-factor {_exact(scaling['factor'])}",
                     f"--original-max-position-embeddings {scaling['original_max_position_embeddings']}",
                     *(f"--{name.replace('_', '-')} {_exact(scaling[name])}"
                       for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"))])


def _exact(number):
    """A number as short as it reads back exactly (40, 0.7071067811865476)."""
    return f"{number:g}" if float(f"{number:g}") == number else repr(number)


def dropless_moe_flags(shape, args):
    """The pretrain.py flags of a dropless MoE model (Megatron-Core's; the routing from its saved arguments)."""
    pattern = ",".join(map(str, shape["dropless_moe_layers"]))
    flags = [f"--num-experts {shape['num_experts'][0]}", f"--moe-layer-freq '[{pattern}]'",
             f"--moe-ffn-hidden-size {shape['moe_ffn_hidden_size']}", f"--moe-router-topk {args['moe_router_topk']}",
             f"--moe-router-score-function {args['moe_router_score_function']}"]
    if args.get("moe_router_num_groups"):
        flags.append(f"--moe-router-num-groups {args['moe_router_num_groups']} --moe-router-group-topk "
                     f"{args['moe_router_group_topk']}")
    if args.get("moe_router_topk_scaling_factor"):
        flags.append(f"--moe-router-topk-scaling-factor {args['moe_router_topk_scaling_factor']:g}")
    if args.get("moe_router_pre_softmax"):
        flags.append("--moe-router-pre-softmax")
    if args.get("moe_router_enable_expert_bias"):
        flags.append("--moe-router-enable-expert-bias")
    if args.get("moe_router_load_balancing_type") not in (None, "aux_loss"):
        flags.append(f"--moe-router-load-balancing-type {args['moe_router_load_balancing_type']}")
    if args.get("moe_aux_loss_coeff"):
        flags.append(f"--moe-aux-loss-coeff {args['moe_aux_loss_coeff']:g}")
    if args.get("moe_grouped_gemm"):
        flags.append("--moe-grouped-gemm")
    if shape["moe_shared_expert_intermediate_size"]:
        flags.append(f"--moe-shared-expert-intermediate-size {shape['moe_shared_expert_intermediate_size']}")
    if shape["moe_shared_expert_gate"]:
        flags.append("--moe-shared-expert-gate")
    return " ".join(flags)


def moe_flags(shape, args):
    """The pretrain.py flags of a model's Mixture of Experts (routing included)."""
    defaults = flag_defaults()
    value = lambda name: args.get(name, defaults[name])  # noqa: E731
    flags = [f"--num-experts {' '.join(map(str, shape['num_experts']))}",
             f"--expert-interval {shape['expert_interval']}", f"--topk {value('topk')}",
             f"--moe-loss-coeff {value('moe_loss_coeff'):g}", f"--moe-min-capacity {value('moe_min_capacity')}"]
    if shape["mlp_type"] != "standard":
        flags.append(f"--mlp-type {shape['mlp_type']}")
    if not value("moe_token_dropping"):
        flags.append("--disable-moe-token-dropping")
    if not value("moe_top2_2nd_expert_sampling"):
        flags.append("--disable-moe-top2-2nd-expert-sampling")
    return " ".join(flags)
