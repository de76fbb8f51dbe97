"""A budget of host syncs per training iteration: the operations that make the host wait for the GPU (.item(),
.tolist(), nonzero, blocking copies, ...; tests/host_syncs.py says which and how a CPU run tells them), counted on
every rank of a TP 2 x PP 2 run in steady state. A new one in the iteration's path fails here with its site."""
import json

import pytest
import torch

from tests.host_syncs import HostSyncCounter
from tests.launch import launch
from tests.layouts import COMMON, FAMILIES

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


@pytest.mark.e2e
def test_host_syncs_per_iteration_stay_within_the_budget(tmp_path):
    result = launch(4, _flags(), program=("-m", "tests.host_syncs", str(tmp_path)), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "lm loss" in result.stdout
    for rank, budget in BUDGET.items():
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for iteration in STEADY:
            counts = report["iterations"][str(iteration)]
            ours = sum(count for _, site, count in report["sites"][str(iteration)] if site.startswith("megatron_ds/"))
            assert sum(counts.values()) <= budget and ours <= OURS, (
                f"rank {rank}, iteration {iteration}: {sum(counts.values())} host syncs ({ours} in megatron_ds), "
                f"budget {budget} ({OURS}):\n{_describe(report, iteration)}")


def test_the_counter_tells_host_tensors_from_device_tensors():
    """What tests/host_syncs.py counts on a CPU-only run, each line as a GPU would see it."""
    device = torch.device("cpu")  # what megatron_ds.launch.runtime.device() is here: the "GPU"
    originals = (torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.cpu, torch.tensor, torch.as_tensor)
    counter = HostSyncCounter()
    counter.iteration = 1
    with counter:
        x = torch.randn(4, device=device)
        x.sum().item()                                        # item
        torch.tensor([1, 2]).tolist()                         # a host tensor: none
        on_host = x.to("cpu")                                 # download
        on_host.tolist()                                      # none
        on_host[0].item()                                     # none
        torch.tensor(3.0).to(device)                          # upload
        torch.tensor(-1.0, device=device)                     # upload
        torch.zeros(3, device=device)                         # none
        x[x > 0]                                              # mask index
        x.to(device)                                          # none
        x.to(torch.float64)                                   # none
        torch.LongTensor([1, 2]).to(device, non_blocking=True)  # none
        torch.empty(4, device=device).copy_(on_host)          # copy
        bool(x.sum() > 0)                                     # item
        torch.nonzero(x > 0)                                  # nonzero
        torch.nonzero(on_host > 0)                            # none
        torch.repeat_interleave(torch.tensor([1, 2], device=device))  # upload, repeat_interleave
    totals = {}
    for (kind, _), count in counter.counts[1].items():
        totals[kind] = totals.get(kind, 0) + count
    assert totals == {"item": 2, "download": 1, "upload": 3, "mask index": 1, "copy": 1, "nonzero": 1,
                      "repeat_interleave": 1}
    assert (torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.cpu, torch.tensor, torch.as_tensor) == originals
