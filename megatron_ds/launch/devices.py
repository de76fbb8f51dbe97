"""Device facts the planner uses: the one table of peak FLOP/s, memory and link bandwidths.

Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s): "intra-node" is the GPU's NVLink
bandwidth through NVSwitch (the PCIe parts: their NVLink bridge, which joins a pair), "inter-node" is the GPU's
share of the node's InfiniBand (one NIC per GPU in the DGX systems). Memory is in GiB as the driver reports it
(e.g. 81920 MiB for an A100-80GB). cuda_names: what torch.cuda.get_device_name() calls the GPU; a GPU named
otherwise (an H100 NVL, an H200 NVL, an A100 40GB PCIe) is not in the table, and its MFU peak is measured
(megatron_ds/observability/throughput.py).
"""
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_16bit_tflops: float      # dense bf16/fp16 tensor-core peak (no sparsity)
    peak_fp32_tflops: float       # plain fp32 (what fp32 training gets without TF32)
    memory_gib: float
    memory_bandwidth_gbs: float   # HBM
    intra_node_gbs: float         # NVLink, per direction
    inter_node_gbs: float         # InfiniBand per GPU, per direction
    source: str
    cuda_names: Tuple[str, ...] = ()
    peak_fp8_tflops: Optional[float] = None   # dense FP8 tensor-core peak; None: no FP8 GEMMs

    def peak_tflops(self, sixteen_bit: bool) -> float:
        return self.peak_16bit_tflops if sixteen_bit else self.peak_fp32_tflops

    def fp8_problem(self) -> Optional[str]:
        """Why FP8 GEMMs cannot run on this device (None where they can)."""
        if self.peak_fp8_tflops is None:
            return f"{self.name} has no FP8 tensor cores (FP8 GEMMs need sm_89 (Ada) or sm_90 (Hopper) and newer)"
        return None


DEVICES = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): BF16 312 TFLOP/s dense (624 with sparsity), FP32 19.5,
    # 40 GB HBM2 1,555 GB/s; NVLink 3: 600 GB/s total = 300 per direction. NVIDIA DGX A100 datasheet:
    # 8 x 200 Gb/s HDR InfiniBand for compute = 25 GB/s per GPU.
    "a100-40gb": DeviceSpec("NVIDIA A100-SXM4-40GB", 312.0, 19.5, 40.0, 1555.0, 300.0, 25.0,
                            "A100 datasheet; DGX A100 datasheet (8 x HDR 200 Gb/s)", ("NVIDIA A100-SXM4-40GB",)),
    # Same datasheets: the 80 GB SXM4 part has HBM2e at 2,039 GB/s.
    "a100-80gb": DeviceSpec("NVIDIA A100-SXM4-80GB", 312.0, 19.5, 80.0, 2039.0, 300.0, 25.0,
                            "A100 datasheet; DGX A100 datasheet (8 x HDR 200 Gb/s)", ("NVIDIA A100-SXM4-80GB",)),
    # A100 datasheet (80GB PCIe): the SXM4 part's compute, HBM2e at 1,935 GB/s; an NVLink bridge joins two GPUs
    # (600 GB/s total = 300 per direction: only within a bridged pair, beyond it PCIe Gen4, 32 GB/s per
    # direction). Inter-node assumed as in a DGX A100, one HDR 200 Gb/s NIC per GPU: PCIe servers often have fewer.
    "a100-80gb-pcie": DeviceSpec("NVIDIA A100-PCIe-80GB", 312.0, 19.5, 80.0, 1935.0, 300.0, 25.0,
                                 "A100 datasheet (PCIe); NVLink bridge pairs; assumed one HDR 200 Gb/s NIC per GPU",
                                 ("NVIDIA A100 80GB PCIe",)),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 989 TFLOP/s dense (1,979 with sparsity), FP8 1,979 dense
    # (3,958 with sparsity), FP32 67,
    # 80 GB HBM3 3.35 TB/s; NVLink 4: 900 GB/s total = 450 per direction. NVIDIA DGX H100 datasheet:
    # 8 x 400 Gb/s NDR InfiniBand (ConnectX-7) = 50 GB/s per GPU.
    "h100-80gb": DeviceSpec("NVIDIA H100-SXM5-80GB", 989.0, 67.0, 80.0, 3350.0, 450.0, 50.0,
                            "H100 datasheet; DGX H100 datasheet (8 x NDR 400 Gb/s)", ("NVIDIA H100 80GB HBM3",),
                            peak_fp8_tflops=1979.0),
    # H100 datasheet (PCIe): BF16 756 TFLOP/s dense (1,513 with sparsity), FP8 1,513 dense (3,026 with sparsity),
    # FP32 51, 80 GB HBM2e 2,000 GB/s; an
    # NVLink bridge joins two GPUs (600 GB/s total = 300 per direction: only within a bridged pair, beyond it PCIe
    # Gen5, 64 GB/s per direction). Inter-node assumed as in a DGX H100, one NDR 400 Gb/s NIC per GPU: PCIe
    # servers often have fewer.
    "h100-pcie": DeviceSpec("NVIDIA H100-PCIe-80GB", 756.0, 51.0, 80.0, 2000.0, 300.0, 50.0,
                            "H100 datasheet (PCIe); NVLink bridge pairs; assumed one NDR 400 Gb/s NIC per GPU",
                            ("NVIDIA H100 PCIe",), peak_fp8_tflops=1513.0),
    # H800 (SXM5, the H100 for the Chinese market): the H100 SXM's compute (FP8 1,979 dense) and HBM3, NVLink cut to
    # 400 GB/s total = 200 per direction (DeepSeek-V3's report, arXiv 2412.19437 section 3.1, measures about
    # 160 GB/s of it); one 400 Gb/s InfiniBand NIC per GPU, 50 GB/s (the same report's figure).
    "h800": DeviceSpec("NVIDIA H800-SXM5-80GB", 989.0, 67.0, 80.0, 3350.0, 200.0, 50.0,
                       "H100 datasheet's compute and memory; NVLink 400 GB/s; DeepSeek-V3 report's 50 GB/s IB",
                       ("NVIDIA H800",), peak_fp8_tflops=1979.0),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM (FP8 1,979 TFLOP/s dense), 141 GB HBM3e
    # 4.8 TB/s, NVLink 900 GB/s total. NVIDIA DGX H200 datasheet: 8 x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU.
    "h200": DeviceSpec("NVIDIA H200-SXM-141GB", 989.0, 67.0, 141.0, 4800.0, 450.0, 50.0,
                       "H200 datasheet; DGX H200 datasheet (8 x NDR 400 Gb/s)", ("NVIDIA H200",),
                       peak_fp8_tflops=1979.0),
    # Nominal, not measured: a many-core server socket. Measure yours with
    # megatron_ds.observability.throughput.measure_matmul_tflops and pass --peak-tflops. torch runs FP8 GEMMs
    # (_scaled_mm) on CPUs without FP8 arithmetic: nominally no faster than 16-bit (bench/ops.py measures slower).
    "cpu": DeviceSpec("CPU (nominal)", 2.0, 2.0, 64.0, 100.0, 20.0, 1.25,
                      "nominal entry (shared memory between ranks, 10 GbE between hosts)", peak_fp8_tflops=2.0),
}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[name]


def device_for_cuda_name(cuda_name: str) -> Optional[DeviceSpec]:
    """The table's entry for the GPU torch.cuda.get_device_name() names; None for a GPU the table does not hold."""
    name = _without_vendor(cuda_name)
    return next((spec for spec in DEVICES.values() if name in map(_without_vendor, spec.cuda_names)), None)


def _without_vendor(cuda_name):
    return cuda_name.strip().removeprefix("NVIDIA ").strip()  # older drivers leave "NVIDIA " out
