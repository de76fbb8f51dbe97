"""A budget of host syncs per training iteration: the operations that make the host wait for the GPU (.item(),
.tolist(), nonzero, blocking copies, ...; tests/support/host_syncs.py says which and how a CPU run tells them),
counted on every rank of a TP 2 x PP 2 run in steady state. A new one in the iteration's path fails here with its
site."""
import json

from tests.support.launch import assert_succeeded, launch
from tests.support.layouts import COMMON, FAMILIES

ITERATIONS, LOG_INTERVAL = 9, 4
STEADY = range(3, ITERATIONS)  # not the first two (caches, first sends) nor the last (the end of training)

# Per rank and iteration, log iterations (4, 8) included (the log line reuses the float of the non-finite check):
# - every rank, megatron_ds/training.py (2): the lm loss .item() after the global batch (_run_micro_batches: the
#   non-finite check, the rerun validator and the log line take it every iteration) and the gradient norm's float
#   (deepspeed_internals.host_global_grad_norm, --check-for-nan-in-loss-and-grad, every iteration; the log line
#   reads the same float). Both come after the optimizer step, the iteration's last device work.
# - every rank, DeepSpeed's ZeRO-1 step (5): is_invalid_grad_norm's bool() in step and in unscale_and_clip_grads
#   (once per parameter group: 2), and mask_nan_or_inf_with_val_inplace's torch.tensor(-1.0, device=...) in
#   get_grad_norm_direct (2 uploads, one per parameter group).
# - every rank, DeepSpeed's pipeline engine (4): PartitionedTensor.to_meta's torch.LongTensor(meta).to(device), once
#   per micro-batch: the activations stage 0 sends, the gradients stage 1 sends (pipe_partitioned / grad_partitioned,
#   engine/ds_config.py).
# - stage 0 (+1): _aggregate_total_loss's torch.Tensor([0., 0.]).to(device), the buffer the last stage's loss is
#   broadcast into.
# - TP rank 1 (+1): get_grad_norm_direct's torch.tensor(0.0).to(device) for a parameter group with no gradient this
#   rank counts in the norm (the replicated ones count on TP rank 0).
# Before the gather/scatter in core/fusions/fused_cross_entropy.py the last stage had 4 more (a torch.nonzero per
# micro-batch in the reference cross entropy's backward), and the logging rank 1 more on log iterations.
BUDGET = {0: 12, 1: 13, 2: 11, 3: 12}  # rank: host syncs per iteration (rank = stage * 2 + TP rank)
OURS = 2  # of which megatron_ds's own, per rank


def _flags():
    flags = list(COMMON)
    flags[flags.index("--train-iters") + 1] = str(ITERATIONS)
    flags[flags.index("--log-interval") + 1] = str(LOG_INTERVAL)
    return flags + FAMILIES["llama"] + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                        "--make-vocab-size-divisible-by", "128"]


def _describe(report, iteration):
    return "\n".join(f"  {count} {kind}: {site}" for kind, site, count in report["sites"][str(iteration)])


def test_host_syncs_per_iteration_stay_within_the_budget(tmp_path):
    result = launch(4, _flags(), program=("-m", "tests.support.host_syncs", str(tmp_path)), timeout=600)
    assert_succeeded(result, tail=4000)
    assert "lm loss" in result.stdout
    for rank, budget in BUDGET.items():
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for iteration in STEADY:
            counts = report["iterations"][str(iteration)]
            ours = sum(count for _, site, count in report["sites"][str(iteration)] if site.startswith("megatron_ds/"))
            assert sum(counts.values()) <= budget and ours <= OURS, (
                f"rank {rank}, iteration {iteration}: {sum(counts.values())} host syncs ({ours} in megatron_ds), "
                f"budget {budget} ({OURS}):\n{_describe(report, iteration)}")
