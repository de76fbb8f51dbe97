"""Per-device peak FLOP/s for MFU: a known-GPU table, or a dense-GEMM rate measured on this device."""
import time

import torch
import torch.distributed as dist

# dense 16-bit tensor-core peaks (TFLOP/s) by a substring of torch.cuda.get_device_name()
KNOWN_GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def known_gpu_peak_tflops():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in KNOWN_GPU_PEAK_TFLOPS.items() if key in name), None)


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
