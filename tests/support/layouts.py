"""Training launches of one small model at a (tp, pp, dp) layout, shared (memoized) by the tests that compare
layouts and memory savers: fp32, no dropout, one seed, per-iteration lm losses."""
import re
import time
from pathlib import Path

from megatron_ds.launch.runtime import available_cores
from tests.support.launch import assert_succeeded, launch, losses

ITERATIONS = 10
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
          "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
          "--clip-grad", "1.0", "--weight-decay", "0.1", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--seed", "7", "--mock-data", "--vocab-size", "250", "--log-interval", "1", "--eval-interval", "0"]
FAMILIES = {
    "gpt2": [],
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2"],
    # DeepSeek-V3's attention: multi-latent, a query latent, YaRN with both of its factors, v head dim of its own
    "mla": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--q-lora-rank", "24",
            "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
            "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--original-max-position-embeddings", "16",
            "--mscale-all-dim", "0.8"],
}
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 1)]

SCHEDULE_FLAGS = {schedule: ["--pipeline-schedule", schedule] for schedule in ("1f1b", "zbh1", "dualpipev")}
SCHEDULE_FLAGS["interleaved"] = ["--num-virtual-stages-per-pipeline-rank", "2"]  # Megatron-LM's spelling
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? grad norm: ([0-9.E+-]+|inf|nan) \|")  # inf: fp16 overflowed
_runs = {}


def run_layout(family, tp, pp, dp, extra=()):
    """Per-iteration losses of one launch; memoized, so test files that need the same run share it."""
    return _run(family, tp, pp, dp, extra)[0]


def run_layout_grad_norms(family, tp, pp, dp, extra=()):
    """Per-iteration grad norms of the same (memoized) launch."""
    return _run(family, tp, pp, dp, extra)[1]


def run_layout_output(family, tp, pp, dp, extra=()):
    """The whole output of the same (memoized) launch."""
    return _run(family, tp, pp, dp, extra)[2]


def _run(family, tp, pp, dp, extra):
    key = (family, tp, pp, dp, tuple(extra))
    if key not in _runs:
        _runs[key] = _launch_layout(family, tp, pp, dp, extra)
    return _runs[key]


def _launch_layout(family, tp, pp, dp, extra):
    flags = COMMON + FAMILIES[family] + ["--tensor-model-parallel-size", str(tp),
                                         "--pipeline-model-parallel-size", str(pp),
                                         "--make-vocab-size-divisible-by", str(256 // tp), *extra]
    started = time.time()
    result = launch(tp * pp * dp, flags)
    assert_succeeded(result, tail=4000)
    # TP over every rank of one host, a core each: DeepSpeed's shared-memory all-reduce (this CPU has its
    # avx512bw kernels)
    shared_memory = "go through DeepSpeed's shared-memory all-reduce" in result.stdout
    assert shared_memory == (tp == tp * pp * dp > 1 and tp <= available_cores()), result.stdout[-4000:]
    left = [path.name for path in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")
            if path.stat().st_mtime >= started]
    assert not left, f"the launch left its shared-memory all-reduce segments in /dev/shm: {left}"
    trajectory = losses(result.stdout)
    assert sorted(trajectory) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    return trajectory, {int(it): float(norm) for it, norm in GRAD_NORM.findall(result.stdout)}, result.stdout
