"""The checkpoint folder (megatron_ds.checkpointing.files): a damaged or incomplete newest checkpoint names
the last good one; a writer killed before the rename or between the two pointers leaves a loadable folder;
the model shape resolves the default FFN width as the model does."""
import subprocess

import pytest

from megatron_ds.checkpointing import discovery, files
from megatron_ds.core.transformer.transformer_config import default_ffn_hidden_size
from tests.support.checkpoints import assert_previous_checkpoint_published, tiny_checkpoint
from tests.support.fault_injection import pause_message
from tests.support.launch import BIN, REPO, lines_within


def test_damaged_or_incomplete_newest_checkpoint_names_the_last_good_one(tmp_path):
    tiny_checkpoint(tmp_path, 2)
    tiny_checkpoint(tmp_path, 4)
    shard = tmp_path / "global_step4" / files.sharded_file_name(0, 0)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk or a half-finished copy
    with pytest.raises(files.CheckpointError) as damaged:
        discovery.resolve_checkpoint(str(tmp_path))
    message = str(damaged.value)
    assert "global_step4 is damaged or incomplete" in message and "bytes" in message
    assert f"the last good checkpoint is {tmp_path / 'global_step2'} (iteration 2)" in message
    assert "--load-iteration 2" in message
    assert discovery.resolve_checkpoint(str(tmp_path), 2)[0] == "global_step2"

    (tmp_path / "global_step4" / files.METADATA_FILE).unlink()  # a save that never finished
    with pytest.raises(files.CheckpointError, match="no megatron_ds_checkpoint.json .*--load-iteration 2"):
        discovery.resolve_checkpoint(str(tmp_path))
    assert discovery.resolve_checkpoint(str(tmp_path / "nothing_here"))[0] is None  # nothing yet: from scratch


def test_a_deepspeed_universal_folder_is_refused_by_name(tmp_path):
    """ds_to_universal's output (a zero/ folder of parameters, no metadata of ours) named by our own pointers is
    named as such, with the flag that loads it."""
    tiny_checkpoint(tmp_path, 2)
    (tmp_path / "global_step2" / files.METADATA_FILE).unlink()
    (tmp_path / "global_step2" / "zero").mkdir()
    with pytest.raises(files.CheckpointError,
                       match="a DeepSpeed universal checkpoint .* load it with --universal-checkpoint"):
        discovery.resolve_checkpoint(str(tmp_path))


def _kill_writer_at(save_dir, phase):
    """Write iteration 4 in a small process held at `phase` of its save, then kill it."""
    point = f"{phase}@4"
    code = (f"from tests.support.fault_injection import hold_save_at; hold_save_at({point!r}); "
            f"from tests.support.checkpoints import tiny_checkpoint; tiny_checkpoint({str(save_dir)!r}, 4)")
    process = subprocess.Popen([str(BIN / "python"), "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    for line in lines_within(process, 120):
        if pause_message(point) in line:
            break
    process.kill()
    process.wait()


@pytest.mark.parametrize("phase", ["metadata", "between-pointers"])
def test_writer_killed_at_the_other_phases(tmp_path, phase):
    """The publishing steps are shared by training saves and the converter; killing a converter-style writer
    (a small process) at the phases the training tests leave out: before the rename, and between Megatron's
    and DeepSpeed's pointer (the new checkpoint is complete there, and the newer pointer names it)."""
    tiny_checkpoint(tmp_path, 2)
    _kill_writer_at(tmp_path, phase)
    if phase == "metadata":
        assert_previous_checkpoint_published(tmp_path)
        assert files.problems_of(str(tmp_path / "global_step4.tmp")) == []  # complete, but never renamed
        return
    assert (tmp_path / files.MEGATRON_TRACKER).read_text().strip() == "4"
    assert (tmp_path / files.DEEPSPEED_POINTER).read_text().strip() == "global_step2"
    tag, _, _ = discovery.resolve_checkpoint(str(tmp_path))
    assert tag == "global_step4" and not files.problems_of(str(tmp_path / tag))
    assert not files.problems_of(str(tmp_path / "global_step2"))


@pytest.mark.parametrize("swiglu", [False, True])
def test_model_shape_resolves_the_default_ffn_width_like_the_model(swiglu):
    saved = {"num_layers": 2, "hidden_size": 192, "num_attention_heads": 4, "swiglu": swiglu}
    assert files.model_shape(saved)["ffn_hidden_size"] == default_ffn_hidden_size(192, swiglu)
    assert files.model_shape({**saved, "ffn_hidden_size": 100})["ffn_hidden_size"] == 100


def test_a_dropless_checkpoint_names_what_differs_from_the_flags():
    """The dropless layer's shape is part of the model: a checkpoint of it does not load into DeepSpeed-MoE nor
    into another pattern of MoE layers, expert FFN or shared expert, each named by its flag."""
    dense = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "swiglu": True, "num_experts": [4]}
    dropless = {**dense, "dropless_moe": True, "moe_layer_freq": [0, 1, 1, 1], "moe_ffn_hidden_size": 48,
                "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}
    saved = files.model_shape(dropless)
    assert saved["dropless_moe_layers"] == [0, 1, 1, 1] and files.is_dropless_moe(saved)
    assert not files.is_dropless_moe(files.model_shape({**dense, "expert_interval": 1}))
    assert files.model_shape({**dropless, "moe_layer_freq": 1}) != saved
    other = files.model_shape({**dropless, "moe_layer_freq": 2, "moe_ffn_hidden_size": 32,
                               "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False})
    differences = "\n".join(files.model_shape_differences(saved, other, 1))
    for flag in ("--moe-layer-freq", "--moe-ffn-hidden-size: checkpoint 48, flags 32",
                 "--moe-shared-expert-intermediate-size: checkpoint 32, flags None",
                 "--moe-shared-expert-gate: checkpoint True, flags False"):
        assert flag in differences, differences
    deepspeed_moe = files.model_shape({**dense, "expert_interval": 1})
    deepspeed_moe = "\n".join(files.model_shape_differences(saved, deepspeed_moe, 1))
    assert "--expert-interval: checkpoint None, flags 1" in deepspeed_moe, deepspeed_moe
