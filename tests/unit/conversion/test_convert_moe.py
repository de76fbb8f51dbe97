"""Mixture of Experts checkpoints and Hugging Face's Mixtral: what Mixtral cannot hold is refused by name, as is an
expert-parallel size that does not divide the experts; a truncated weight file is named. Imports and exports of real
models: tests/e2e/tools/test_convert_moe.py."""
import pytest

from megatron_ds.checkpointing import files
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.conversion import convert, huggingface
from tests.support.hf_models import tiny_mixtral


def _moe_args(**overrides):
    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "ffn_hidden_size": 48, "padded_vocab_size": 128, "normalization": "RMSNorm", "swiglu": True,
            "use_rotary_position_embeddings": True, "position_embedding_type": "rope", "disable_bias_linear": True,
            "untie_embeddings_and_output_weights": True, "num_experts": [4], "expert_interval": 1, "topk": 2,
            "mlp_type": "standard", "seq_length": 16}
    return {**args, **overrides}


@pytest.mark.parametrize("overrides, expected", [
    ({"expert_interval": 2}, "--expert-interval 2"),
    ({"num_experts": [4, 8]}, "--num-experts 4 8"),
    ({"mlp_type": "residual"}, "--mlp-type residual"),
    ({"topk": 1}, "--topk 1"),
])
def test_export_refuses_what_mixtral_cannot_hold(overrides, expected):
    with pytest.raises(CheckpointError, match="MixtralForCausalLM cannot hold") as error:
        args = _moe_args(**overrides)
        huggingface.to_hf_state(files.model_shape(args), args, {}, 128)
    assert expected in str(error.value)


def test_converter_refuses_an_expert_parallel_size_that_does_not_divide_the_experts(tmp_path, capsys):
    tiny_mixtral(tmp_path / "hf")
    from megatron_ds.conversion.convert_cli import main
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "out"),
                 "--target-expert-parallel-size", "3"]) == 2
    assert "--num-experts 4 is not divisible by --target-expert-parallel-size 3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="--target-pipeline-model-parallel-size 2 would hold no MoE"):
        convert._check_target(files.model_shape(_moe_args(expert_interval=2, num_layers=2)), 1, 2)


def test_a_mixtral_imported_as_the_dropless_layer_may_split_its_experts_over_tp_where_they_divide(tmp_path, capsys):
    """--target-expert-tensor-parallelism on with --moe-layer dropless: the files hold whole experts (expert TP 1 in
    the saved flags) and the printed flags train them split over TP; TP 1, or a TP that does not divide an expert's
    FFN size (Mixtral's 48 here), is refused before anything is written."""
    tiny_mixtral(tmp_path / "hf")
    from megatron_ds.conversion.convert_cli import main
    common = ["--from-hf", str(tmp_path / "hf"), "--moe-layer", "dropless", "--target-expert-tensor-parallelism", "on"]
    assert main([*common, "--save", str(tmp_path / "tp2"), "--target-tensor-parallel-size", "2"]) == 0
    assert "--expert-tensor-parallel-size 2" in capsys.readouterr().out
    saved = files.read_metadata(str(tmp_path / "tp2" / files.RELEASE_TAG))
    assert saved["args"]["expert_tensor_parallel_size"] == 1
    for tp, expected in (("1", "--target-tensor-parallel-size 1 has no TP ranks to split the experts over"),
                         ("32", "each expert's FFN size 48 (--moe-ffn-hidden-size) is not divisible by "
                                "--target-tensor-parallel-size 32")):
        assert main([*common, "--save", str(tmp_path / tp), "--target-tensor-parallel-size", tp]) == 2
        assert expected in capsys.readouterr().err
        assert not (tmp_path / tp).exists()


def test_a_truncated_hugging_face_weight_file_is_named(tmp_path, capsys):
    """--from-hf on a model.safetensors cut in half: one line naming the file, exit 2, nothing written."""
    tiny_mixtral(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    from megatron_ds.conversion.convert_cli import main
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "out")]) == 2
    assert f"{weights} is damaged (truncated or not safetensors)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
