"""tools/generate.py on LLaMAs with RoPE scaling imported from Hugging Face (rope_type llama3: LLaMA-3.1's; yarn,
original context 64): greedy generation with the KV cache, at TP 2 (torchrun) and TP 1, gives transformers' own
generate's tokens, the YaRN model's running past its original context (a 70-token prompt)."""
import pytest
import torch

from megatron_ds.conversion import convert
from tests.support.hf_models import LLAMA31_ROPE, YARN_ROPE, tiny_scaled_llama
from tests.support.launch import run_generate

LONG_PROMPT = [(7 * i + 3) % 97 for i in range(70)]
PROMPTS = ["--prompt-ids", "5,17,42", "--prompt-ids", ",".join(map(str, LONG_PROMPT))]
MAX_NEW = 16


@pytest.mark.parametrize("rope", [LLAMA31_ROPE, YARN_ROPE], ids=["llama3", "yarn"])
def test_greedy_generation_at_tp2_and_tp1_is_transformers(rope, tmp_path):
    hf_model = tiny_scaled_llama(tmp_path / "hf", rope, seed=3)
    convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), 2, 1)
    common = ["--load", tmp_path / "ckpt", *PROMPTS, "--max-new-tokens", MAX_NEW, "--ignore-eod", "--output-format",
              "json"]
    tp2, tp1 = run_generate(2, *common), run_generate(1, *common)
    assert len(tp1) == 2 and tp2 == tp1
    for record in tp1:
        prompt = torch.tensor([record["prompt_ids"]])
        with torch.no_grad():  # the mask given: transformers would mask the prompt's 0s, its pad_token_id
            reference = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert record["generated_ids"] == reference[0, len(record["prompt_ids"]):].tolist()
        assert len(set(record["generated_ids"])) > 2  # not one token repeated
