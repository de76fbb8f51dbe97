"""Checkpoints of other programs (checkpointing/foreign/recognition.py) are refused by what they hold, never called
damaged (a Megatron-DeepSpeed --load folder is read instead, its tag folder named): Megatron-DeepSpeed's, written
here by code that follows its file layout (Megatron-DeepSpeed is not vendored), Megatron-LM's two formats, DeepSpeed
files of another program, a Hugging Face folder; a damaged one names its file."""
import argparse

import pytest
import torch

from megatron_ds.checkpointing import discovery, files


def _megatron_deepspeed_args(tp, pp, world):
    return argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=world,
                              num_layers=2, hidden_size=8, num_attention_heads=2)


def _pointers(load_dir, iteration, tag):
    (load_dir / "latest").write_text(tag)
    (load_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def megatron_deepspeed_checkpoint(load_dir, tp=1, pp=1, world=1, iteration=5):
    """Its layout at PP 1: mp_rank_XX_model_states.pt with a nested `module`; at PP > 1 `module` None and one
    layer_{NN}-model_{TT}-model_states.pt per layer (embedding 1, layers 2..L+1, final norm L+2)."""
    tag = load_dir / f"global_step{iteration}"
    tag.mkdir(parents=True)
    hidden = torch.zeros(8)
    for rank in range(tp):
        module = None if pp > 1 else {"language_model": {
            "embedding": {"word_embeddings": {"weight": torch.zeros(16, 8)}},
            "encoder": {"layers.0.input_layernorm.weight": hidden, "final_layernorm.weight": hidden}}}
        torch.save({"module": module, "args": _megatron_deepspeed_args(tp, pp, world), "checkpoint_version": 3.0,
                    "iteration": iteration, "tokens": 1280, "rng_state": [], "buffer_names": []},
                   tag / f"mp_rank_{rank:02d}_model_states.pt")
        if pp > 1:
            for layer in range(1, 2 + 3):
                torch.save({"weight": hidden}, tag / f"layer_{layer:02d}-model_{rank:02d}-model_states.pt")
    _pointers(load_dir, iteration, tag.name)
    return tag


def refusal(load_dir):
    with pytest.raises(files.CheckpointError) as raised:
        discovery.resolve_checkpoint(str(load_dir))
    message = str(raised.value)
    assert "damaged" not in message and "not a megatron_ds checkpoint" in message, message
    return message


@pytest.mark.parametrize("tp, pp, world, layout", [(1, 1, 1, "TP 1 x PP 1 x DP 1"), (1, 2, 2, "TP 1 x PP 2 x DP 1"),
                                                   (2, 2, 8, "TP 2 x PP 2 x DP 2")])
def test_a_megatron_deepspeed_checkpoint_is_read_and_its_tag_folder_named(tmp_path, tp, pp, world, layout):
    """Its --load folder is read (megatron_deepspeed.py: described with its version and layout); its tag folder
    given to --load instead is named, with the folder to give."""
    tag = megatron_deepspeed_checkpoint(tmp_path, tp, pp, world)
    found, metadata, _ = discovery.resolve_checkpoint(str(tmp_path))
    assert (found, metadata["format"], metadata["iteration"]) == (tag.name, files.FORMAT_MEGATRON_DEEPSPEED, 5)
    assert metadata["description"] == f"Megatron-DeepSpeed checkpoint (version 3.0, {layout})"
    assert f"{tag} holds a Megatron-DeepSpeed checkpoint (version 3.0, {layout}, iteration 5): give --load the " \
           f"folder that holds it and its pointer `latest` ({tmp_path})" in refusal(tag)


def test_deepspeed_files_of_another_program_are_named_for_what_they_lack(tmp_path):
    tag = tmp_path / "global_step3"
    tag.mkdir()
    torch.save({"module": {"weight": torch.zeros(2)}, "buffer_names": []}, tag / "mp_rank_00_model_states.pt")
    _pointers(tmp_path, 3, tag.name)
    assert "holds DeepSpeed files without megatron_ds or Megatron-DeepSpeed metadata (mp_rank_00_model_states.pt " \
           "has no args or checkpoint_version)" in refusal(tmp_path)


def test_a_damaged_megatron_deepspeed_file_is_named(tmp_path):
    tag = megatron_deepspeed_checkpoint(tmp_path)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    with pytest.raises(files.CheckpointError, match="mp_rank_00_model_states.pt unreadable .*a damaged DeepSpeed or "
                                                    "Megatron-DeepSpeed checkpoint"):
        discovery.resolve_checkpoint(str(tmp_path))


def test_megatron_lm_checkpoints_are_named_by_format(tmp_path):
    torch_dist, legacy = tmp_path / "torch_dist", tmp_path / "legacy"
    for load_dir in (torch_dist, legacy):
        (load_dir / "iter_0000005").mkdir(parents=True)
        (load_dir / "latest_checkpointed_iteration.txt").write_text("5")
    (torch_dist / "iter_0000005" / "__0_0.distcp").write_bytes(b"")
    (torch_dist / "iter_0000005" / ".metadata").write_bytes(b"")
    (legacy / "iter_0000005" / "mp_rank_00").mkdir()
    torch.save({"model": {}}, legacy / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")
    assert "holds a Megatron-LM torch_dist checkpoint" in refusal(torch_dist)
    assert "holds a Megatron-LM checkpoint in its legacy format (mp_rank_00/model_optim_rng.pt)" in refusal(legacy)


def test_a_hugging_face_folder_given_to_load_is_named_with_its_conversion(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert f"--from-hf {tmp_path} --save DIR" in refusal(tmp_path)


def test_a_universal_checkpoint_given_to_load_without_its_flag_is_named(tmp_path):
    """ds_to_universal's output folder (its pointer latest_universal, no checkpoint of ours) given to --load without
    --universal-checkpoint: named with the flag, not trained from scratch."""
    (tmp_path / "global_step3_universal" / "zero").mkdir(parents=True)
    (tmp_path / "latest_universal").write_text("global_step3_universal")
    message = refusal(tmp_path)
    assert "holds a DeepSpeed universal checkpoint" in message and "load it with --universal-checkpoint" in message
