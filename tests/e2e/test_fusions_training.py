"""The model with fused ops (torch.compile backend on this CPU; Triton runs on GPUs) trains like the
registry's references: same losses within fp32 tolerance, for both families, through pretrain.py. With
dropout: every backend draws the same masks for the same seed (GPT-2 with the flash attention op, whose
mask is a hash of one seed; LLaMA with the local attention's softmax op). The compiled run builds its
graphs in its first two iterations and none after."""
import pytest

from tests.support.launch import assert_succeeded, launch, losses

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "2e-3",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--mock-data",
         "--vocab-size", "250", "--log-interval", "1", "--eval-interval", "0"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2", "--ffn-hidden-size", "128"]


@pytest.mark.parametrize("family", [["--attention-backend", "flash"], LLAMA + ["--attention-backend", "local"]],
                         ids=["gpt2", "llama"])
def test_compiled_fusions_train_like_the_reference(family):
    runs = {}
    for backend in ("reference", "compile"):
        result = launch(1, FLAGS + family + ["--fusion-backend", backend], timeout=900)
        assert_succeeded(result, tail=3000)
        runs[backend] = losses(result.stdout)
    assert "=reference" not in result.stdout.split("fused ops")[1].splitlines()[0]  # every op compiled
    assert "graphs in" in result.stdout and "0 recompilations after this run's first 2 iterations" in result.stdout
    assert sorted(runs["compile"]) == [1, 2, 3, 4]
    for iteration, loss in runs["reference"].items():
        assert runs["compile"][iteration] == pytest.approx(loss, rel=1e-5), (iteration, runs)
