"""Per-device peak FLOP/s for MFU: a known-GPU table, or a dense-GEMM rate measured on this device."""
import time

import torch
import torch.distributed as dist

from megatron_ds.launch.devices import device_for_cuda_name

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def known_gpu_peak_tflops(dtype):
    """The dense peak in `dtype` of this GPU from the planner's device table (the one source of device facts),
    looked up by the name CUDA gives it; None for devices the table does not hold."""
    if not torch.cuda.is_available():
        return None
    spec = device_for_cuda_name(torch.cuda.get_device_name())
    return None if spec is None else spec.peak_tflops(sixteen_bit=dtype in SIXTEEN_BIT)


PROBE_SIZE = 256  # a CPU whose 16-bit matmuls are emulated (~2 GFLOP/s) spends ~15 ms on one of these


def measure_matmul_tflops(dtype, device, size=768, repeats=6, budget_s=0.5):
    """TFLOP/s of a square matmul in `dtype`, measured on every rank at once (so ranks sharing a CPU
    are measured sharing it) and averaged over the world. Where a first small product says the measurement would
    take more than budget_s (16-bit on a CPU without 16-bit matrix instructions: seconds per launch), the small
    product is measured instead."""
    if device.type == "cpu" and size > PROBE_SIZE and _seconds_per_matmul(dtype, device, PROBE_SIZE) * (
            size / PROBE_SIZE) ** 3 * (repeats + 1) > budget_s:
        size = PROBE_SIZE
    generator = torch.Generator().manual_seed(0)  # not the global one: the size chosen above depends on timing
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    torch.matmul(a, b)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = 2.0 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12
    return _mean_over_world(rate, device)


def _seconds_per_matmul(dtype, device, size):
    a = torch.full((size, size), 0.5, device=device, dtype=dtype)
    torch.matmul(a, a)
    start = time.perf_counter()
    torch.matmul(a, a)
    return time.perf_counter() - start


def _mean_over_world(value, device):
    """`value` averaged over every rank, reduced on `device`: NCCL reduces only GPU tensors."""
    if not dist.is_initialized():
        return value
    total = torch.tensor([value], device=device)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def peak_tflops_per_device(user_value, dtype, device):
    """(peak, where it came from) for the MFU column."""
    if user_value is not None:
        return user_value, "--peak-tflops"
    known = known_gpu_peak_tflops(dtype)
    if known is not None:
        return known, f"table ({torch.cuda.get_device_name()})"
    return measure_matmul_tflops(dtype, device), f"measured {str(dtype).replace('torch.', '')} matmul"
