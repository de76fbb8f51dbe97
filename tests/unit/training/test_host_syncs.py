"""What tests/support/host_syncs.py counts as host syncs (the operations that make the host wait for the GPU:
.item(), .tolist(), nonzero, blocking copies, ...) on a CPU-only run, each as a GPU would see it. The budget per
training iteration: tests/e2e/test_host_syncs.py."""
import torch

from tests.support.host_syncs import HostSyncCounter


def test_the_counter_tells_host_tensors_from_device_tensors():
    """What tests/support/host_syncs.py counts on a CPU-only run, each line as a GPU would see it."""
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
