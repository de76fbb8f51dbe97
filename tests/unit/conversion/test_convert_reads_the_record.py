"""Conversion reads the model a checkpoint recorded (its "model"), not a shape re-derived from its saved
flags: a checkpoint whose saved flags misremember the heads and the FFN width still reshapes by its record,
and the reshaped checkpoint records the same model."""
from megatron_ds.checkpointing import files
from megatron_ds.conversion.convert_cli import main
from tests.support.checkpoints import full_state, tiny_checkpoint


def _misremember_flags(folder):
    """Rewrite the checkpoint's saved arguments with a head count and an FFN width that TP 2 cannot split."""
    metadata = files.read_metadata(folder)
    metadata["args"].update(num_attention_heads=3, ffn_hidden_size=101)
    files.write_json(f"{folder}/{files.METADATA_FILE}", metadata)
    return metadata["model"]


def test_reshape_follows_the_recorded_model(tmp_path, capsys):
    folder, _ = tiny_checkpoint(tmp_path / "ckpt", 2)
    recorded = _misremember_flags(folder)
    assert (recorded["num_attention_heads"], recorded["ffn_hidden_size"]) == (4, 128)
    assert main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "tp2"), "--target-tensor-parallel-size",
                 "2", "--target-pipeline-model-parallel-size", "1", "--no-optim"]) == 0, capsys.readouterr().err
    reshaped = tmp_path / "tp2" / files.read_pointer(str(tmp_path / "tp2"))
    assert files.read_metadata(str(reshaped))["model"] == recorded
    original, back = full_state(folder), full_state(reshaped)
    assert original.model == back.model == {k: v for k, v in recorded.items() if k != "family"}
    assert all(original.weights[name].equal(back.weights[name]) for name in original.weights)
