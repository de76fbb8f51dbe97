"""tools/generate.py: greedy generation with the KV cache gives the same tokens at TP 2 (launched with
torchrun) as at TP 1, and as Hugging Face's own generate on the model it came from; the cached forward
equals the full forward; sampling is seeded."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_ds.checkpointing import files
from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import KVCache, SamplingParams, build_model, forward_step, generate
from tests.launch import BIN, REPO
from tests.tools.hf_models import VOCAB, full_forward_logits, tiny_gpt2, tiny_llama

PROMPTS = ["--prompt-ids", "5,17,42", "--prompt-ids", "3", "--prompt", "7 8 9 10 11"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A random GQA LLaMA from Hugging Face, imported as our checkpoint at TP 2."""
    root = tmp_path_factory.mktemp("generate")
    hf_model = tiny_llama(root / "hf", seed=3)
    convert.from_hf(str(root / "hf"), str(root / "ckpt"), 2, 1)
    return root, hf_model


def _generate(nproc, *argv):
    command = ([str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(_port())]
               if nproc > 1 else [sys.executable])
    result = subprocess.run(command + ["tools/generate.py", *map(str, argv)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _port():
    from tests.distributed import free_port
    return free_port()


@pytest.mark.e2e
def test_greedy_generation_at_tp2_equals_tp1_and_hugging_face(llama_checkpoint):
    root, hf_model = llama_checkpoint
    common = ["--load", root / "ckpt", *PROMPTS, "--max-new-tokens", MAX_NEW, "--ignore-eod", "--output-format",
              "json"]
    tp2, tp1 = _generate(2, *common), _generate(1, *common)
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


@pytest.mark.parametrize("family, rotary_percent", [("llama", 1.0), ("llama", 0.5), ("gpt2", None)],
                         ids=["llama", "llama-partial-rotary", "gpt2"])
def test_cached_forward_equals_full_forward(tmp_path, family, rotary_percent):
    (tiny_llama if family == "llama" else tiny_gpt2)(tmp_path / "hf")
    full = convert.read_hf(str(tmp_path / "hf"))
    if rotary_percent is not None:  # as a checkpoint trained with --rotary-percent records it
        full.args["rotary_percent"] = rotary_percent
    model_parallel_cuda_manual_seed(0)
    model = build_model(full)
    if rotary_percent is not None:
        assert model.layers[0].self_attention.rotary.rotary_dim == int(8 * rotary_percent)  # head dim 8
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(len(model.layers))
    pieces = [forward_step(model, ids[:, :7], cache)] + [forward_step(model, ids[:, i:i + 1], cache)
                                                        for i in range(7, 20)]
    assert cache.length == 20 and cache.keys[0].shape[0] == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_forward_logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
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
