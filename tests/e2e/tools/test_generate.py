"""tools/generate.py: greedy generation with the KV cache gives the same tokens at TP 2 (launched with torchrun) as
at TP 1, and as Hugging Face's own generate on the model it came from; sampling is seeded."""
import pytest
import torch

from megatron_ds.checkpointing import files
from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import SamplingParams, build_model, generate
from tests.support.hf_models import VOCAB, tiny_llama
from tests.support.launch import run_generate

PROMPTS = ["--prompt-ids", "5,17,42", "--prompt-ids", "3", "--prompt", "7 8 9 10 11"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A random GQA LLaMA from Hugging Face, imported as our checkpoint at TP 2."""
    root = tmp_path_factory.mktemp("generate")
    hf_model = tiny_llama(root / "hf", seed=3)
    convert.from_hf(str(root / "hf"), str(root / "ckpt"), 2, 1)
    return root, hf_model


def test_greedy_generation_at_tp2_equals_tp1_and_hugging_face(llama_checkpoint):
    root, hf_model = llama_checkpoint
    common = ["--load", root / "ckpt", *PROMPTS, "--max-new-tokens", MAX_NEW, "--ignore-eod", "--output-format",
              "json"]
    tp2, tp1 = run_generate(2, *common), run_generate(1, *common)
    assert len(tp1) == 3 and tp2 == tp1
    assert [record["prompt_ids"] for record in tp1] == [[5, 17, 42], [3], [7, 8, 9, 10, 11]]
    assert tp1[2]["prompt"] == "7 8 9 10 11" and tp1[2]["text"].split() == [str(i) for i in tp1[2]["generated_ids"]]
    for record in tp1:
        assert len(record["generated_ids"]) == MAX_NEW
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([record["prompt_ids"]]), max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert record["generated_ids"] == reference[0, len(record["prompt_ids"]):].tolist()
    model_parallel_cuda_manual_seed(0)
    from_hf = build_model(convert.read_hf(str(root / "hf")))  # what generate.py --hf runs
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_at_eod=False)
    assert [generate(from_hf, record["prompt_ids"], params, VOCAB) for record in tp1] == \
        [record["generated_ids"] for record in tp1]


def test_sampling_is_seeded_and_top_k_1_is_greedy(llama_checkpoint):
    root, _ = llama_checkpoint
    full, _ = convert.load_full(str(root / "ckpt"), with_optimizer=False)
    model_parallel_cuda_manual_seed(0)
    model = build_model(full)
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, stop_at_eod=False)
    first = generate(model, [1, 2, 3], sampled, VOCAB, seed=7)
    assert first == generate(model, [1, 2, 3], sampled, VOCAB, seed=7)
    assert all(0 <= token < VOCAB for token in first)
    greedy = generate(model, [1, 2, 3], SamplingParams(max_new_tokens=10, stop_at_eod=False), VOCAB)
    top_1 = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=1, stop_at_eod=False)
    assert generate(model, [1, 2, 3], top_1, VOCAB, seed=1) == greedy
    assert files.read_pointer(str(root / "ckpt")) == files.RELEASE_TAG
