"""tools/convert_checkpoint.py on a checkpoint with partial rotary embeddings (--rotary-percent 0.5), in process:
a TP/PP reshape keeps rotary_percent (the reshaped checkpoint rebuilds the same model, and the suggested flags name
it), and --to-hf refuses it by name, since Hugging Face's LlamaForCausalLM rotates every channel of a head."""
import torch

from megatron_ds.checkpointing import files, state
from megatron_ds.conversion import convert
from megatron_ds.conversion.convert_cli import main
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state
from tests.support.hf_models import VOCAB, full_forward_logits, tiny_llama


def test_reshape_keeps_rotary_percent_and_hugging_face_export_refuses_it(tmp_path, capsys):
    tiny_llama(tmp_path / "hf")  # head dim 8
    full = convert.read_hf(str(tmp_path / "hf"))
    full.args.update(rotary_percent=0.5, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     world_size=1)  # as a run with --rotary-percent 0.5 records it
    state.write_sharded_checkpoint(full, str(tmp_path / "ckpt"), 1, 1, tag=files.RELEASE_TAG, with_optimizer=False)
    assert main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "tp2"), "--target-tensor-parallel-size",
                 "2", "--target-pipeline-model-parallel-size", "1", "--no-optim"]) == 0
    original = full_state(tmp_path / "ckpt" / files.RELEASE_TAG)
    reshaped = full_state(tmp_path / "tp2" / files.read_pointer(str(tmp_path / "tp2")))
    assert reshaped.args["rotary_percent"] == 0.5 and files.model_shape(reshaped.args)["rotary_percent"] == 0.5
    assert "--use-rotary-position-embeddings --rotary-base 5000 --rotary-percent 0.5" in \
        convert.model_flags(reshaped.model, reshaped.args)
    model_parallel_cuda_manual_seed(0)
    partial, reshaped_model = build_model(original), build_model(reshaped)
    assert partial.layers[0].self_attention.rotary.rotary_dim == 4
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = full_forward_logits(partial, ids)
    torch.testing.assert_close(full_forward_logits(reshaped_model, ids), logits)
    full.args["rotary_percent"] = 1.0
    assert not torch.allclose(full_forward_logits(build_model(full), ids), logits, atol=1e-3)  # it matters

    assert main(["--to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "exported")]) == 2
    error = capsys.readouterr().err
    assert "LlamaForCausalLM has no partial rotary embeddings: this model has rotary_percent 0.5" in error, error
    assert not (tmp_path / "exported").exists()
