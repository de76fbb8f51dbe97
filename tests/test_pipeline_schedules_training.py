"""The zero-bubble ZB-H1 schedule inside DeepSpeed's pipeline engine trains exactly what 1F1B trains: the same
lm loss and grad norm at every iteration (fp32, dropout 0), at PP 2 and PP 4 with tied embeddings, at TP 2 x
PP 2 with Megatron's sequence parallelism and untied embeddings (LLaMA), in bf16, and with an MoE layer in each
stage under full recompute. The weight gradients are taken later but in 1F1B's order, so the updates are 1F1B's."""
import pytest

from tests.layouts import ITERATIONS, run_layout, run_layout_grad_norms

pytestmark = pytest.mark.e2e  # launches several real processes

ZBH1 = ["--pipeline-schedule", "zbh1"]
CASES = {
    "gpt2-pp2": ("gpt2", 1, 2, 1, []),
    "gpt2-pp4": ("gpt2", 1, 4, 1, []),
    "llama-tp2-pp2-sp": ("llama", 2, 2, 1, ["--sequence-parallel"]),
    "llama-tp2-pp2-bf16": ("llama", 2, 2, 1, ["--bf16"]),
    # an MoE layer in each stage, with full recompute (one launch pair for both: the suite's time)
    "gpt2-pp2-moe-full-recompute": ("gpt2", 1, 2, 1, ["--num-experts", "2", "--expert-interval", "1",
                                                      "--recompute-granularity", "full", "--recompute-method",
                                                      "uniform"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_bubble_trains_what_one_forward_one_backward_trains(case):
    family, tp, pp, dp, extra = CASES[case]
    expected_losses, expected_norms = (run_layout(family, tp, pp, dp, extra),
                                       run_layout_grad_norms(family, tp, pp, dp, extra))
    losses, norms = (run_layout(family, tp, pp, dp, extra + ZBH1),
                     run_layout_grad_norms(family, tp, pp, dp, extra + ZBH1))
    assert expected_losses[ITERATIONS] < expected_losses[1]
    assert losses == expected_losses and norms == expected_norms, (losses, expected_losses, norms, expected_norms)
