"""Per-device peak FLOP/s for MFU: a known-GPU table, or a dense-GEMM rate measured on this device."""
import time

import torch
import torch.distributed as dist

from megatron_ds.planning.devices import DEVICES


def known_gpu_peak_tflops():
    """The dense 16-bit peak of this GPU from the planner's device table (the one source of device facts),
    matched by model name (A100, H100, H200); None for other devices."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for spec in DEVICES.values():
        model = spec.name.split()[-1].split("-")[0]
        if spec.name.startswith("NVIDIA") and model in name:
            return spec.peak_16bit_tflops
    return None


def measure_matmul_tflops(dtype, device, size=768, repeats=6):
    """TFLOP/s of a square matmul in `dtype`, measured on every rank at once (so ranks sharing a CPU
    are measured sharing it) and averaged over the world."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = torch.tensor([2.0 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12])
    if dist.is_initialized():
        dist.all_reduce(rate)
        rate /= dist.get_world_size()
    return rate.item()


def peak_tflops_per_device(user_value, dtype, device):
    """(peak, where it came from) for the MFU column."""
    if user_value is not None:
        return user_value, "--peak-tflops"
    known = known_gpu_peak_tflops()
    if known is not None:
        return known, f"table ({torch.cuda.get_device_name()})"
    return measure_matmul_tflops(dtype, device), f"measured {str(dtype).replace('torch.', '')} matmul"
