"""tools/convert_checkpoint.py: reshaping keeps training exact (optimizer states included) and is lossless
there and back; Hugging Face export and import reproduce every tensor and the logits, for both model
families; a model imported from Hugging Face fine-tunes with pretrain.py --finetune."""
import os

import pytest
import torch

from megatron_ds.checkpointing import files, state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state, layout_flags
from tests.support.hf_models import VOCAB, full_forward_logits, hf_logits, tiny_gpt2, tiny_llama
from tests.support.launch import assert_succeeded, launch, losses

COMMON = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
          "--vocab-size", str(VOCAB), "--lr", "2e-3", "--lr-decay-style", "cosine", "--log-interval", "1",
          "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5",
          "--weight-decay", "0.1"]
LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-key-value-heads", "2",
         "--ffn-hidden-size", "64", "--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
GPT2 = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--max-position-embeddings", "32"]
TARGETS = [(1, 1, 1), (1, 2, 2), (2, 1, 1)]


def _train(nproc, flags):
    result = launch(nproc, flags, timeout=300)
    assert_succeeded(result, tail=5000)
    return result.stdout


def _convert(*argv):
    from megatron_ds.conversion.convert_cli import main
    assert main([str(a) for a in argv]) == 0


def _assert_same_state(expected, observed, with_optimizer=True):
    assert sorted(expected.weights) == sorted(observed.weights)
    for name, tensor in expected.weights.items():
        assert torch.equal(tensor, observed.weights[name]), name
        if with_optimizer:
            for key in state.OPTIMIZER_KEYS:
                assert torch.equal(expected.optimizer[name][key], observed.optimizer[name][key]), (name, key)
    if with_optimizer:
        assert expected.optimizer_step == observed.optimizer_step
        assert expected.scheduler == observed.scheduler
        assert (expected.iteration, expected.consumed_train_samples) == \
            (observed.iteration, observed.consumed_train_samples)


def _our_logits(folder, ids):
    model_parallel_cuda_manual_seed(0)
    return full_forward_logits(build_model(full_state(folder)), ids)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """LLaMA family (GQA, SwiGLU, RoPE, untied) trained 8 iterations at (2,2,1), saved at 4 and 8."""
    root = tmp_path_factory.mktemp("llama")
    output = _train(4, COMMON + LLAMA + layout_flags(2, 2) + ["--train-iters", "8", "--save", root / "ckpt",
                                                         "--save-interval", "4"])
    return root, losses(output)


@pytest.fixture(scope="module")
def gpt2_from_hf(tmp_path_factory):
    """A random GPT2LMHeadModel imported at (2,2,1), then fine-tuned 2 iterations by pretrain.py --finetune."""
    root = tmp_path_factory.mktemp("gpt2")
    hf_model = tiny_gpt2(root / "hf")
    _convert("--from-hf", root / "hf", "--save", root / "imported", "--target-tensor-parallel-size", 2,
             "--target-pipeline-model-parallel-size", 2, "--make-vocab-size-divisible-by", 64)
    output = _train(4, COMMON + GPT2 + layout_flags(2, 2) + ["--train-iters", "2", "--load", root / "imported",
                                                        "--finetune", "--save", root / "finetuned"])
    return root, hf_model, output


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: "tp{}-pp{}-dp{}".format(*t))
def test_reshaped_checkpoint_trains_on_like_the_unreshaped_run(llama_run, tmp_path, target):
    root, expected = llama_run
    tp, pp, dp = target
    _convert("--load", root / "ckpt", "--load-iteration", 4, "--save", tmp_path / "reshaped",
             "--target-tensor-parallel-size", tp, "--target-pipeline-model-parallel-size", pp)
    output = _train(tp * pp * dp, COMMON + LLAMA + layout_flags(tp, pp) + ["--train-iters", "8", "--load",
                                                                      tmp_path / "reshaped"])
    assert "resuming at iteration 4, consumed samples 16, optimizer states loaded" in output, output[-3000:]
    observed = losses(output)
    assert sorted(observed) == [5, 6, 7, 8]
    for iteration in observed:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-5), (iteration, observed, expected)


def test_reshape_there_and_back_reproduces_every_tensor(llama_run, gpt2_from_hf, tmp_path):
    """(2,2,1) -> each target -> (2,2,1): weights, fp32 master weights, Adam moments, step, scheduler, data
    position all come back bit for bit, for both families (the GPT-2 one with tied embeddings)."""
    sources = [llama_run[0] / "ckpt" / "global_step4", gpt2_from_hf[0] / "finetuned" / "global_step2"]
    for number, source in enumerate(sources):
        original = full_state(source)
        assert original.optimizer is not None
        for tp, pp, _ in TARGETS:
            there, back = tmp_path / f"{number}_tp{tp}_pp{pp}", tmp_path / f"{number}_tp{tp}_pp{pp}_back"
            _convert("--load", source.parent, "--load-iteration", original.iteration, "--save", there,
                     "--target-tensor-parallel-size", tp, "--target-pipeline-model-parallel-size", pp)
            _convert("--load", there, "--save", back, "--target-tensor-parallel-size", 2,
                     "--target-pipeline-model-parallel-size", 2)
            _assert_same_state(original, full_state(back / f"global_step{original.iteration}"))
    _convert("--load", sources[0].parent, "--save", tmp_path / "no_optim", "--target-tensor-parallel-size", 1,
             "--target-pipeline-model-parallel-size", 1, "--no-optim")
    assert full_state(tmp_path / "no_optim" / "global_step8").optimizer is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_export_matches_logits_and_round_trips(llama_run, gpt2_from_hf, tmp_path, family):
    """ours -> HF: the HF model's logits equal ours (fp32, 1e-4); HF -> ours (same layout) gives back every
    tensor and the same model shape."""
    from transformers import AutoModelForCausalLM
    source = (llama_run[0] / "ckpt") if family == "llama" else (gpt2_from_hf[0] / "finetuned")
    _convert("--to-hf", "--load", source, "--save", tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf_model).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[family]
    tag = files.read_pointer(str(source))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ours, theirs = _our_logits(source / tag, ids), hf_logits(hf_model, ids)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "back", "--target-tensor-parallel-size", 2,
             "--target-pipeline-model-parallel-size", 2)
    original, back = full_state(source / tag), full_state(tmp_path / "back" / files.RELEASE_TAG)
    _assert_same_state(original, back, with_optimizer=False)
    assert files.model_shape(original.args) == files.model_shape(back.args)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_import_matches_logits(gpt2_from_hf, tmp_path, family):
    """A random HF model (LLaMA with grouped-query attention, or GPT-2) imported at TP 2 x PP 2: our model's
    logits equal the HF model's on the tokenizer's vocabulary (fp32, 1e-4)."""
    if family == "gpt2":
        root, hf_model, _ = gpt2_from_hf
        folder = root / "imported" / files.RELEASE_TAG
    else:
        hf_model = tiny_llama(tmp_path / "hf")
        _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "imported", "--target-tensor-parallel-size", 2,
                 "--target-pipeline-model-parallel-size", 2)
        folder = tmp_path / "imported" / files.RELEASE_TAG
    metadata = files.read_metadata(str(folder))
    assert metadata["model"]["family"] == family and metadata["format"] == files.FORMAT_SHARDED
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    ours = _our_logits(folder, ids)
    torch.testing.assert_close(hf_logits(hf_model, ids), ours[..., :VOCAB], rtol=1e-4, atol=1e-4)


def test_imported_model_finetunes_with_pretrain(gpt2_from_hf):
    root, _, output = gpt2_from_hf
    assert "megatron_ds-sharded format" in output and "(--finetune: iteration 0)" in output, output[-3000:]
    assert sorted(losses(output)) == [1, 2]
    assert files.read_pointer(str(root / "finetuned")) == "global_step2"


def test_converter_refuses_impossible_targets(llama_run, tmp_path, capsys):
    from megatron_ds.conversion.convert_cli import main
    assert main(["--load", str(llama_run[0] / "ckpt"), "--save", str(tmp_path / "x"),
                 "--target-tensor-parallel-size", "4", "--target-pipeline-model-parallel-size", "3"]) == 2
    error = capsys.readouterr().err
    assert "--num-key-value-heads 2 is not divisible by --target-tensor-parallel-size 4" in error
    assert "--num-layers 2 is not divisible by --target-pipeline-model-parallel-size 3" in error
    assert not os.path.exists(tmp_path / "x" / "global_step8")


def test_tokenizer_files_travel_with_the_model(tmp_path):
    """A Hugging Face folder's tokenizer.json becomes the imported checkpoint's tokenizer, and an export of
    that checkpoint carries it again (loadable by AutoTokenizer, same ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megatron_ds.data.tokenizers import build_tokenizer
    tiny_llama(tmp_path / "hf")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "ckpt")
    args = files.read_metadata(str(tmp_path / "ckpt" / files.RELEASE_TAG))["args"]
    assert args["tokenizer_type"] == "HuggingFaceTokenizer"
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=args["tokenizer_model"])
    _convert("--to-hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "hf2")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf2")
    text = "the lazy fox"
    assert exported(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert exported.eos_token == "</s>"
