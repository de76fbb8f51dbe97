"""Checkpoints megatron_ds did not write, named for what they hold, so that --load and tools/convert_checkpoint.py
refuse them by that name instead of calling them damaged.

    foreign_checkpoint(path)   what the checkpoint folder `path` (one tag: global_stepN/, iter_NNNNNNN/) holds when
                               it is another program's, with what to do; None when it is none we know
    foreign_folder(load_dir)   the same for a --load folder whose checkpoints are not in our tag folders
                               (Megatron-LM's iter_NNNNNNN/)

Recognised: Megatron-DeepSpeed's (DeepSpeed's mp_rank_XX_model_states.pt with its `args` and
`checkpoint_version`; megatron_deepspeed.py reads them in their --load folder, so only the tag folder itself given to
--load is named here), DeepSpeed's universal checkpoints (a zero/ folder),
Megatron-LM's torch_dist (*.distcp) and legacy (mp_rank_XX/model_optim_rng.pt) formats, DeepSpeed files of
another program (no `args`), and Hugging Face model folders.
"""
import os
import re

import torch

_MODEL_STATES = re.compile(r"mp_rank_(\d\d)_model_states\.pt")
_MEGATRON_LM_RANK_FOLDER = re.compile(r"mp_rank_\d\d(_\d\d\d)?")
_MEGATRON_LM_TAG = re.compile(r"iter_\d{7}")
_HF_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)")

UNIVERSAL = ("a DeepSpeed universal checkpoint (ds_to_universal's output, a zero/ folder of parameters): load it "
             "with --universal-checkpoint (its pointer latest_universal must name it), or load the checkpoint it "
             "was made from: --load reshards any layout")
MEGATRON_LM_ADVICE = ("megatron_ds does not read Megatron-LM's checkpoints: convert it to Hugging Face with "
                      "Megatron-LM's tools/checkpoint, then with tools/convert_checkpoint.py --from-hf")


def foreign_checkpoint(path):
    """The description of what another program's checkpoint folder `path` holds (module docstring), or None."""
    if not os.path.isdir(path):
        return None
    names = set(os.listdir(path))
    if os.path.isdir(os.path.join(path, "zero")):
        return UNIVERSAL
    if any(name.endswith(".distcp") for name in names):
        return f"a Megatron-LM torch_dist checkpoint (PyTorch distributed checkpoint shards, *.distcp): " \
               f"{MEGATRON_LM_ADVICE}"
    legacy = sorted(name for name in names if _MEGATRON_LM_RANK_FOLDER.fullmatch(name)
                    and os.path.isfile(os.path.join(path, name, "model_optim_rng.pt")))
    if legacy:
        return f"a Megatron-LM checkpoint in its legacy format ({legacy[0]}/model_optim_rng.pt): {MEGATRON_LM_ADVICE}"
    model_states = sorted(name for name in names if _MODEL_STATES.fullmatch(name))
    if model_states:
        return _deepspeed_files(path, model_states)
    if "config.json" in names and any(_HF_WEIGHTS.fullmatch(name) for name in names):
        return (f"a Hugging Face model (config.json and its weights): convert it with tools/convert_checkpoint.py "
                f"--from-hf {path} --save DIR, then --load DIR")
    return None


def foreign_folder(load_dir):
    """What a --load folder holds when it is another program's checkpoint itself (a Hugging Face model, a tag
    folder of DeepSpeed files) or its checkpoints are Megatron-LM's iter_NNNNNNN/ folders; None otherwise."""
    if not os.path.isdir(load_dir):
        return None
    itself = foreign_checkpoint(load_dir)
    if itself is not None:
        return itself
    universal = os.path.join(load_dir, "latest_universal")
    if os.path.isfile(universal):
        return (f"a DeepSpeed universal checkpoint ({universal} names {open(universal).read().strip()!r}): load it "
                f"with --universal-checkpoint")
    tags = sorted(name for name in os.listdir(load_dir) if _MEGATRON_LM_TAG.fullmatch(name))
    if not tags:
        return None
    inside = foreign_checkpoint(os.path.join(load_dir, tags[-1]))
    return inside or f"Megatron-LM checkpoint folders ({', '.join(tags)}): {MEGATRON_LM_ADVICE}"


def _deepspeed_files(path, model_states):
    try:
        state = peek(os.path.join(path, model_states[0]))
    except Exception as error:   # whatever unpickling a damaged or foreign file raises
        return (f"DeepSpeed model states, {model_states[0]} unreadable ({type(error).__name__}: {error}): a damaged "
                f"DeepSpeed or Megatron-DeepSpeed checkpoint")
    if not isinstance(state, dict) or "args" not in state or "checkpoint_version" not in state:
        return (f"DeepSpeed files without megatron_ds or Megatron-DeepSpeed metadata ({model_states[0]} has no "
                f"args or checkpoint_version): megatron_ds needs the model and layout a checkpoint was saved with, "
                f"which these files do not record")
    return (f"a Megatron-DeepSpeed checkpoint ({_megatron_deepspeed_layout(state)}): give --load the folder that "
            f"holds it and its pointer `latest` ({os.path.dirname(os.path.abspath(path))}), or convert it with "
            f"tools/convert_checkpoint.py --from-megatron-deepspeed")


def _megatron_deepspeed_layout(state):
    """'version 3.0, TP a x PP b x DP c, iteration N' from what Megatron-DeepSpeed saves beside the weights."""
    args = state["args"]
    tp = getattr(args, "tensor_model_parallel_size", None)
    pp = getattr(args, "pipeline_model_parallel_size", None)
    world = getattr(args, "world_size", None)
    dp = world // (tp * pp) if tp and pp and world else "?"
    return (f"version {state['checkpoint_version']}, TP {tp or '?'} x PP {pp or '?'} x DP {dp}, "
            f"iteration {state.get('iteration', '?')}")


def peek(path):
    """The file's top-level object, its tensors memory-mapped (a 500B model's states are not read to look)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:   # not the zip format: mmap needs it
        return torch.load(path, map_location="cpu", weights_only=False)
