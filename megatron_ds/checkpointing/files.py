"""The on-disk checkpoint folder: pointers, metadata, completeness checks, atomic writes, and the
model-shape comparison that guards `--load`.

    DIR/latest                              DeepSpeed's pointer: the tag of the newest published checkpoint
    DIR/latest_checkpointed_iteration.txt   Megatron's pointer: its iteration (or "release")
    DIR/global_step{N}/                     one checkpoint (tag "release" for converted Hugging Face weights)
        megatron_ds_checkpoint.json         metadata, written last: format, iteration, data position, scheduler,
                                            arguments, the model ("model": its shape, which --load compares;
                                            "model_config": the run's TransformerConfig), layout, and every
                                            other file of the folder with its size ("files") and its CRC-32
                                            ("checksums", computed while writing it)
        ds_config.json                      the effective DeepSpeed config of the run that saved it
        rng_state_rank_{NNNNN}.pt           every rank's RNG states (training saves only)
        ...                                 DeepSpeed's files (format "deepspeed") or
                                            model_optim_tp{TT}_pp{PPP}.pt (format "megatron_ds-sharded", converter)
    DIR/global_step{N}.tmp/                 a save in progress, or one killed mid-way: never loaded

A checkpoint is published by renaming its finished, fsync'ed temporary folder, then replacing the
pointers (write, fsync, rename): a save killed at any moment leaves the previous checkpoint and the
pointers on it (tests kill saves at the phases of megatron_ds.checkpointing.hooks). A file whose bytes change
later (same size) no longer matches its checksum, which --load verifies before reading anything.
"""
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import zlib

import torch

from megatron_ds.checkpointing.hooks import reached_save_phase
from megatron_ds.core.transformer.transformer_config import MLA_FIELDS, default_ffn_hidden_size, moe_layer_pattern

METADATA_FILE = "megatron_ds_checkpoint.json"
DS_CONFIG_FILE = "ds_config.json"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_POINTER = "latest"
RELEASE_TAG = "release"
TMP_SUFFIX = ".tmp"
FORMAT_DEEPSPEED = "deepspeed"
FORMAT_SHARDED = "megatron_ds-sharded"
FORMAT_MEGATRON_DEEPSPEED = "megatron-deepspeed"  # its own files, described by megatron_deepspeed.read_metadata
# DeepSpeed's ds_to_universal output of one of its checkpoints (megatron_deepspeed.read_universal_metadata)
FORMAT_MEGATRON_DEEPSPEED_UNIVERSAL = "megatron-deepspeed universal"
FORMAT_VERSION = 1
CHECKSUM_CHUNK_BYTES = 4 * 2 ** 20  # a file is read for its checksum in pieces this large
_TAG = re.compile(r"^global_step(\d+)$")
# what killed saves leave: checkpoint folders being written or replaced, pointer temporaries
_LEFTOVER = re.compile(r"^((global_step\d+|release)(\.tmp|\.old\.\d+)|(latest|latest_checkpointed_iteration\.txt)"
                       r"\.tmp\.\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded as asked; the message is meant for the user as is."""


def tag_for(iteration):
    return f"global_step{iteration}"


def iteration_of(tag):
    """The iteration a tag names (0 for "release"), or None when it is not a checkpoint tag."""
    if tag == RELEASE_TAG:
        return 0
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def sharded_file_name(tp_rank, pp_rank):
    return f"model_optim_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def rng_file_name(rank):
    return f"rng_state_rank_{rank:05d}.pt"


# --- durable writes ---------------------------------------------------------------------------------

class CheckpointSaveError(Exception):
    """A save that could not be written (no space, permission, ...): the message names the file and the OS error,
    and says what is left of the previous checkpoint."""


@contextlib.contextmanager
def naming_file(path):
    """An OSError raised inside names path (a failed write() or fsync() names no file)."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = path
        raise


def fsync_path(path):
    """Flush a file's or a folder's contents (a folder: its entries) to disk."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    with naming_file(path):
        descriptor = os.open(path, flags)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def atomic_write_text(path, text):
    """Write text to path so readers see the old or the new content, never a mix (also after a crash)."""
    tmp = f"{path}{TMP_SUFFIX}.{os.getpid()}"
    with naming_file(tmp), open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_json(path, data):
    with naming_file(path), open(path, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_torch_file(state, path):
    """torch.save through our own file handle, fsync'ed, so a failed write raises its OSError naming path
    (torch.save given a path reports one as a RuntimeError naming neither). Returns the file's checksum,
    computed from the bytes as they are written."""
    with naming_file(path), open(path, "wb") as handle:
        summed = _ChecksummedFile(handle)
        torch.save(state, summed)
        handle.flush()
        os.fsync(handle.fileno())
    return checksum_text(summed.crc)


class _ChecksummedFile:
    """A binary file to write that keeps the CRC-32 of everything written to it (torch.save writes in order)."""

    def __init__(self, handle):
        self._handle, self.crc = handle, 0

    def write(self, data):
        self.crc = zlib.crc32(data, self.crc)
        return self._handle.write(data)

    def flush(self):
        self._handle.flush()


def checksum_text(crc):
    return f"crc32:{crc:08x}"


def file_checksum(path):
    """The checksum of a file's content (read in CHECKSUM_CHUNK_BYTES pieces), as write_torch_file returns it."""
    crc, buffer = 0, bytearray(CHECKSUM_CHUNK_BYTES)
    view = memoryview(buffer)
    with naming_file(path), open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return checksum_text(crc)


def share_of(names, rank, world_size):
    """The names (sorted) this rank handles when the ranks split a folder's files round-robin."""
    return sorted(names)[rank::world_size]


def folder_files(path):
    """{relative path: size} of every file under path (the metadata file itself excluded)."""
    sizes = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, path)
            if relative != METADATA_FILE:
                sizes[relative] = os.path.getsize(full)
    return sizes


def start_folder(save_dir, tag):
    """(tmp_tag, tmp_path): a fresh temporary folder for the checkpoint `tag` to be written into, then published
    (publish); the leftovers of killed saves are removed first."""
    os.makedirs(save_dir, exist_ok=True)
    remove_stale_temporaries(save_dir)
    tmp_tag = tag + TMP_SUFFIX
    tmp_path = os.path.join(save_dir, tmp_tag)
    os.makedirs(tmp_path)
    return tmp_tag, tmp_path


def publish(save_dir, tmp_tag, tag, iteration_text):
    """Rename the finished folder save_dir/tmp_tag to save_dir/tag, then point both pointers at it.
    Called by one process after every file of the checkpoint (metadata last) is fsync'ed."""
    tmp_path, final_path = os.path.join(save_dir, tmp_tag), os.path.join(save_dir, tag)
    reached_save_phase("metadata", iteration_text)
    fsync_path(tmp_path)
    if os.path.exists(final_path):  # an older run saved this iteration: replace it
        old = f"{final_path}.old.{os.getpid()}"
        os.rename(final_path, old)
        os.rename(tmp_path, final_path)
        _remove_tree(old)
    else:
        os.rename(tmp_path, final_path)
    fsync_path(save_dir)
    reached_save_phase("pointers", iteration_text)
    atomic_write_text(os.path.join(save_dir, MEGATRON_TRACKER), f"{iteration_text}\n")
    reached_save_phase("between-pointers", iteration_text)
    atomic_write_text(os.path.join(save_dir, DEEPSPEED_POINTER), f"{tag}\n")


def _remove_tree(path):
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(save_dir):
    """Folders and pointer temporaries left by saves that were killed; returns their names."""
    if not os.path.isdir(save_dir):
        return []
    stale = [name for name in os.listdir(save_dir) if _LEFTOVER.match(name)]
    for name in stale:
        path = os.path.join(save_dir, name)
        if os.path.isdir(path):
            _remove_tree(path)
        else:
            os.remove(path)
    return stale


# --- reading ----------------------------------------------------------------------------------------

def read_metadata(path):
    with open(os.path.join(path, METADATA_FILE)) as handle:
        return json.load(handle)


def problems_of(path):
    """Why the checkpoint folder `path` cannot be loaded; [] when it is complete."""
    if not os.path.isdir(path):
        return [f"{path} does not exist"]
    try:
        metadata = read_metadata(path)
    except FileNotFoundError:
        return [f"no {METADATA_FILE} (the save did not finish)"]
    except (OSError, ValueError) as error:
        return [f"{METADATA_FILE} is unreadable ({error})"]
    problems = []
    for name, size in sorted(metadata.get("files", {}).items()):
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file_path) != size:
            problems.append(f"{name} has {os.path.getsize(file_path)} bytes, {size} were written")
    if not metadata.get("files"):
        problems.append(f"{METADATA_FILE} lists no files")
    return problems


def list_tags(load_dir):
    """Checkpoint tags in load_dir (complete or not), oldest first; temporaries excluded."""
    if not os.path.isdir(load_dir):
        return []
    tags = [name for name in os.listdir(load_dir)
            if iteration_of(name) is not None and os.path.isdir(os.path.join(load_dir, name))]
    return sorted(tags, key=lambda tag: (iteration_of(tag), tag != RELEASE_TAG))


def read_pointer(load_dir):
    """The tag the pointers name: Megatron's tracker, else DeepSpeed's `latest`; None when neither exists.
    Each is written atomically; if a save died between the two, the newer one is taken."""
    tags = []
    tracker = os.path.join(load_dir, MEGATRON_TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        tags.append(RELEASE_TAG if text == RELEASE_TAG else tag_for(int(text)) if text.isdigit() else None)
    latest = os.path.join(load_dir, DEEPSPEED_POINTER)
    if os.path.isfile(latest):
        tags.append(open(latest).read().strip())
    tags = [tag for tag in tags if tag and iteration_of(tag) is not None]
    return max(tags, key=iteration_of) if tags else None


def last_good_tag(load_dir, below=None):
    """The newest complete checkpoint (optionally older than iteration `below`), or None."""
    for tag in reversed(list_tags(load_dir)):
        if below is not None and iteration_of(tag) >= below:
            continue
        if not problems_of(os.path.join(load_dir, tag)):
            return tag
    return None


def checksum_problems(path, checksums):
    """'NAME has checksum ..., ... was written' for each file of the folder `path` in checksums ({name: checksum})
    whose content is not what was written; [] when all match."""
    problems = []
    for name, written in sorted(checksums.items()):
        try:
            found = file_checksum(os.path.join(path, name))
        except OSError as error:
            problems.append(f"{name} is unreadable ({error})")
            continue
        if found != written:
            problems.append(f"{name} has checksum {found}, {written} was written (its bytes changed after the save)")
    return problems


def damaged_checkpoint_error(load_dir, tag, problems):
    """The CheckpointError for the checkpoint load_dir/tag with `problems`, naming the last good checkpoint."""
    return CheckpointError(f"checkpoint {os.path.join(load_dir, tag)} is damaged or incomplete: "
                           f"{'; '.join(problems)}. {last_good_hint(load_dir, iteration_of(tag))}")


def last_good_hint(load_dir, below):
    good = last_good_tag(load_dir, below)
    if good is None:
        return "there is no older complete checkpoint in the folder"
    iteration = iteration_of(good)
    return (f"the last good checkpoint is {os.path.join(load_dir, good)} (iteration {iteration}): load it with "
            f"--load {load_dir} --load-iteration {good if good == RELEASE_TAG else iteration}")


def load_file(path, what="checkpoint file"):
    """torch.load on CPU, with a CheckpointError naming the file when it is unreadable."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # truncated zip, pickle errors, ...
        raise CheckpointError(f"{what} {path} is damaged: {error}") from None


# --- arguments and model shape ----------------------------------------------------------------------

def model_shape(args):
    """The model-defining values of a run (args: a namespace or a saved dict), defaults resolved."""
    get = args.get if isinstance(args, dict) else lambda name, default=None: getattr(args, name, default)
    heads = get("num_attention_heads")
    swiglu = bool(get("swiglu"))
    kv_channels = get("kv_channels") or get("hidden_size") // heads
    ffn = get("ffn_hidden_size") or default_ffn_hidden_size(get("hidden_size"), swiglu)
    position = get("position_embedding_type") or "learned_absolute"
    if get("use_rotary_position_embeddings"):
        position = "rope"
    return {
        "num_layers": get("num_layers"), "hidden_size": get("hidden_size"), "num_attention_heads": heads,
        "num_key_value_heads": get("num_key_value_heads") or heads, "kv_channels": kv_channels,
        "ffn_hidden_size": ffn, "padded_vocab_size": get("padded_vocab_size"),
        "max_position_embeddings": get("max_position_embeddings") if position == "learned_absolute" else None,
        "normalization": get("normalization") or "LayerNorm", "swiglu": swiglu, "position_embedding_type": position,
        "rotary_percent": float(get("rotary_percent") or 1.0) if position == "rope" else None,
        "rope_scaling": _rope_scaling_shape(get) if position == "rope" else None,
        "bias": not get("disable_bias_linear"),
        # the QKV projection's own bias: with the linear layers' biases it has one anyway
        "add_qkv_bias": bool(get("add_qkv_bias")) and bool(get("disable_bias_linear")),
        "qk_layernorm": bool(get("qk_layernorm")),
        **_mla_shape(get),
        "tied_embeddings": not get("untie_embeddings_and_output_weights"),
        "mtp_num_layers": int(get("mtp_num_layers") or 0),
        **_experts_shape(get),
    }


def fp8_scaling_state(args):
    """The FP8 state a run's linears keep (args: a namespace or a saved dict): delayed scaling's history length and
    the layers --first-last-layers-bf16 keeps out, as a list; None without delayed scaling. Not part of the model's
    shape: a load between runs that differ in it places or starts the state per rank."""
    get = args.get if isinstance(args, dict) else lambda name, default=None: getattr(args, name, default)
    if get("fp8_format") is None or get("fp8_recipe") != "delayed":
        return None
    kept_out = [get("num_layers_at_start_in_bf16"), get("num_layers_at_end_in_bf16")]
    return [get("fp8_amax_history_len"), kept_out if get("first_last_layers_bf16") else None]


def _mla_shape(get):
    """Multi-latent attention's sizes (None each without it)."""
    mla = bool(get("multi_latent_attention"))
    return {"multi_latent_attention": mla, **{name: get(name) if mla else None for name in MLA_FIELDS[1:]}}


def _rope_scaling_shape(get):
    """The RoPE scaling (it changes the model's function): None, LLaMA-3.1's or YaRN's with its values."""
    if get("use_rope_scaling"):
        return {"type": "llama3", "factor": float(get("rope_scaling_factor"))}
    if get("rope_type") != "yarn":
        return None
    return {"type": "yarn", "factor": float(get("rotary_scaling_factor")),
            "original_max_position_embeddings": int(get("original_max_position_embeddings")),
            **{name: float(get(name)) for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")}}


_NOT_DROPLESS = {"dropless_moe_layers": None, "moe_ffn_hidden_size": None,
                 "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": None}


def _experts_shape(get):
    """Mixture of Experts: the experts per MoE layer, and DeepSpeed-MoE's interval and residual MLP or the dropless
    layer's pattern of MoE layers, expert FFN and shared expert; dense: one expert."""
    counts = list(get("num_experts") or [1])
    if max(counts) <= 1:
        return {"num_experts": [1], "expert_interval": None, "mlp_type": None, **_NOT_DROPLESS}
    if get("dropless_moe"):
        return {"num_experts": counts, "expert_interval": None, "mlp_type": None,
                "dropless_moe_layers": list(moe_layer_pattern(get("moe_layer_freq"), get("num_layers"))),
                "moe_ffn_hidden_size": get("moe_ffn_hidden_size"),
                "moe_shared_expert_intermediate_size": get("moe_shared_expert_intermediate_size"),
                "moe_shared_expert_gate": bool(get("moe_shared_expert_gate"))}
    return {"num_experts": counts, "expert_interval": get("expert_interval"),
            "mlp_type": get("mlp_type") or "standard", **_NOT_DROPLESS}


def is_moe(shape):
    return max(shape["num_experts"]) > 1


def is_dropless_moe(shape):
    return shape.get("dropless_moe_layers") is not None


_LLAMA_ATTENTION_FAMILIES = {(False, False): "llama", (True, False): "qwen2", (False, True): "qwen3"}


def model_family(shape):
    """gpt2, llama, qwen2 (LLaMA's with a QKV bias), qwen3 (LLaMA's with query and key norms), deepseek_v3
    (LLaMA's layers with multi-latent attention) or custom."""
    parts = (shape["normalization"], shape["swiglu"], shape["position_embedding_type"], shape["bias"])
    attention = (bool(shape.get("add_qkv_bias")), bool(shape.get("qk_layernorm")))
    if shape.get("multi_latent_attention"):
        return "deepseek_v3" if parts == ("RMSNorm", True, "rope", False) and not any(attention) else "custom"
    if parts == ("RMSNorm", True, "rope", False):
        return _LLAMA_ATTENTION_FAMILIES.get(attention, "custom")
    if parts == ("LayerNorm", False, "learned_absolute", True) and not any(attention):
        return "gpt2"
    return "custom"


_SHAPE_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
                "num_attention_heads": "--num-attention-heads", "num_key_value_heads": "--num-key-value-heads",
                "kv_channels": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
                "padded_vocab_size": "padded vocabulary (--vocab-size / tokenizer, --make-vocab-size-divisible-by, TP)",
                "max_position_embeddings": "--max-position-embeddings", "normalization": "--normalization",
                "swiglu": "--swiglu", "position_embedding_type": "--position-embedding-type",
                "rotary_percent": "--rotary-percent", "num_experts": "--num-experts",
                "rope_scaling": "RoPE scaling (--rope-type yarn and its flags, --use-rope-scaling "
                                "--rope-scaling-factor)",
                "expert_interval": "--expert-interval", "mlp_type": "--mlp-type",
                "dropless_moe_layers": "the dropless MoE layers (Megatron-Core's MoE flags, --moe-layer-freq)",
                "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
                "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
                "moe_shared_expert_gate": "--moe-shared-expert-gate",
                "bias": "biases (--disable-bias-linear)", "add_qkv_bias": "--add-qkv-bias",
                "qk_layernorm": "--qk-layernorm",
                **{name: f"--{name.replace('_', '-')}" for name in MLA_FIELDS},
                "tied_embeddings": "tied embeddings (--untie-embeddings-and-output-weights)",
                "mtp_num_layers": "--mtp-num-layers"}


def saved_model_shape(metadata):
    """The model a checkpoint holds as it recorded it when saved (its "model"); a value a checkpoint from before
    that value was recorded lacks is derived from its saved arguments."""
    recorded = {key: value for key, value in metadata.get("model", {}).items() if key != "family"}
    return {**model_shape(metadata["args"]), **recorded}


def config_record(config):
    """A dataclass configuration (the run's TransformerConfig) as JSON values: dtypes by name."""
    return {key: str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value
            for key, value in dataclasses.asdict(config).items()}


def model_shape_differences(saved, current, tensor_parallel_size):
    """['--hidden-size: checkpoint 64, flags 32', ...] for every model-defining value that differs. saved: the
    checkpoint's model (saved_model_shape); current: the run's (model_shape of its arguments), at TP
    tensor_parallel_size."""
    differences = [f"{_SHAPE_FLAGS[key]}: checkpoint {saved[key]}, flags {current[key]}"
                   for key in saved if saved[key] != current[key]]
    if saved["padded_vocab_size"] != current["padded_vocab_size"] and saved["padded_vocab_size"]:
        tp = tensor_parallel_size
        if saved["padded_vocab_size"] % tp == 0:
            differences.append(f"(to keep the checkpoint's {saved['padded_vocab_size']} vocabulary rows at TP {tp}, "
                               f"pass --make-vocab-size-divisible-by {saved['padded_vocab_size'] // tp})")
    if differences:
        saved_family, family = model_family(saved), model_family(current)
        if saved_family != family:
            differences.insert(0, f"model family: checkpoint {saved_family}, flags {family}")
    return differences


def new_metadata(checkpoint_format, tag, args_dict, checkpoint_layout, iteration=0, consumed_train_samples=0,
                 consumed_valid_samples=0, scheduler=None, model=None, **extra):
    """The metadata dict both formats share (the file list is added when the folder is complete). model: the
    model's shape as loading and conversion read it back (model_shape; default: of args_dict)."""
    import deepspeed
    metadata = {"format": checkpoint_format, "version": FORMAT_VERSION, "tag": tag, "iteration": iteration,
                "consumed_train_samples": consumed_train_samples, "consumed_valid_samples": consumed_valid_samples,
                "scheduler": scheduler, "args": args_dict, "model": dict(model or model_shape(args_dict)),
                "layout": checkpoint_layout, "torch_version": torch.__version__,
                "deepspeed_version": deepspeed.__version__,
                "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    metadata["model"]["family"] = model_family(metadata["model"])
    metadata.update(extra)
    return metadata


def finish_folder(path, metadata, checksums=None):
    """Record every file of the folder with its size and checksum in the metadata, fsync them, write the metadata
    last. checksums: {name: checksum} of the files whose checksum was computed while writing them; the others
    (small files: ds_config.json, the scripts DeepSpeed copies in) are read here."""
    metadata["files"] = folder_files(path)
    known = checksums or {}
    metadata["checksums"] = {name: known.get(name) or file_checksum(os.path.join(path, name))
                             for name in metadata["files"]}
    for name in metadata["files"]:
        fsync_path(os.path.join(path, name))
    write_json(os.path.join(path, METADATA_FILE), metadata)


def args_to_dict(args):
    """The arguments as a checkpoint records them: vars(args) as JSON values (dtypes become their names), without
    the typed parts of the configuration (arguments/configs.py: values derived from the others)."""
    result = {}
    for key, value in sorted(vars(args).items()):
        if dataclasses.is_dataclass(value):
            continue
        if isinstance(value, torch.dtype):
            value = str(value).replace("torch.", "")
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        result[key] = value
    return result
