"""Which checkpoint --load DIR [--load-iteration N] names, in our format or Megatron-DeepSpeed's, and why none
can be loaded when that is so: resolve_checkpoint."""
import os

from megatron_ds.checkpointing import files
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import megatron_deepspeed, recognition


def resolve_checkpoint(load_dir, iteration=None):
    """(tag, metadata, notes) of the checkpoint --load DIR [--load-iteration N] names; (None, None, notes)
    when the folder holds no checkpoint at all. Raises CheckpointError for a damaged or missing one. A
    Megatron-DeepSpeed checkpoint is described in our metadata's terms (megatron_deepspeed.read_metadata)."""
    notes = []
    if not os.path.isdir(load_dir):
        if iteration is not None:
            raise CheckpointError(f"--load {load_dir}: no such folder")
        return None, None, [f"--load {load_dir}: no such folder; starting from scratch"]
    if not files.list_tags(load_dir) and not os.path.isfile(os.path.join(load_dir, files.METADATA_FILE)):
        _refuse_foreign(load_dir, recognition.foreign_folder(load_dir))
    temporaries = [name for name in os.listdir(load_dir) if name.endswith(files.TMP_SUFFIX)]
    if temporaries:
        notes.append(f"ignoring incomplete save(s) {', '.join(sorted(temporaries))} in {load_dir} (a save was killed)")
    if iteration is not None:
        tag = files.RELEASE_TAG if str(iteration) == files.RELEASE_TAG else files.tag_for(int(iteration))
        if not os.path.isdir(os.path.join(load_dir, tag)):
            available = ", ".join(files.list_tags(load_dir)) or "none"
            raise CheckpointError(f"--load {load_dir} --load-iteration {iteration}: no folder {tag} "
                                  f"(checkpoints there: {available})")
    else:
        tag = files.read_pointer(load_dir)
        tags = files.list_tags(load_dir)
        if tag is None:
            if not tags:
                return None, None, notes + [f"--load {load_dir}: no checkpoint there; starting from scratch"]
            raise CheckpointError(f"--load {load_dir}: the folder has checkpoint folders ({', '.join(tags)}) but "
                                  f"no pointer ({files.MEGATRON_TRACKER} or {files.DEEPSPEED_POINTER}); "
                                  f"{files.last_good_hint(load_dir, None)}")
        newer = [t for t in tags if files.iteration_of(t) > files.iteration_of(tag)]
        for newer_tag in newer:
            problems = files.problems_of(os.path.join(load_dir, newer_tag))
            state = ("damaged or incomplete (" + "; ".join(problems) + ")") if problems else "complete"
            notes.append(f"{newer_tag} is newer than the pointers' {tag} but was not published (a save killed "
                         f"before updating the pointers?); it is {state}; loading {tag}")
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, files.METADATA_FILE)):
        if megatron_deepspeed.is_checkpoint(path):
            return tag, megatron_deepspeed.read_metadata(path), notes
        _refuse_foreign(path, recognition.foreign_checkpoint(path))
    problems = files.problems_of(path)
    if problems:
        raise files.damaged_checkpoint_error(load_dir, tag, problems)
    return tag, files.read_metadata(path), notes


def _refuse_foreign(path, holds):
    if holds is not None:
        raise CheckpointError(f"--load: {path} holds {holds}; it is not a megatron_ds checkpoint")
