"""The MFU peak per device (observability/throughput.py): a GPU is looked up in the planner's device table by the
name CUDA gives it, exactly (an H100 PCIe is not an H100 SXM); other devices are measured, the rate averaged over
the world on the run's device (NCCL reduces only GPU tensors)."""
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ds.launch.devices import DEVICES, device_for_cuda_name
from megatron_ds.observability import throughput
from megatron_ds.planning.dry_run.collective_devices import CollectiveDevices, nccl_refusals

# torch.cuda.get_device_name() of each GPU -> its entry in the device table (None: not held, measured)
CUDA_NAMES = [("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", None),
              ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", None), ("NVIDIA H800", "h800"),
              ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
              ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
              ("NVIDIA A100-PCIE-40GB", None), ("A100-SXM4-40GB", "a100-40gb"),   # an older driver's name
              ("Tesla V100-SXM2-32GB", None), ("NVIDIA GeForce RTX 4090", None), ("", None)]


@pytest.mark.parametrize("cuda_name,device", CUDA_NAMES)
def test_a_gpu_is_found_by_its_exact_cuda_name(cuda_name, device):
    assert device_for_cuda_name(cuda_name) is (None if device is None else DEVICES[device])


def test_the_pcie_parts_have_their_own_datasheet_figures():
    h100 = DEVICES["h100-pcie"]
    assert (h100.peak_16bit_tflops, h100.peak_fp32_tflops, h100.memory_gib, h100.memory_bandwidth_gbs) == \
        (756.0, 51.0, 80.0, 2000.0)
    a100, a100_sxm = DEVICES["a100-80gb-pcie"], DEVICES["a100-80gb"]
    assert a100.peak_16bit_tflops == a100_sxm.peak_16bit_tflops and a100.memory_bandwidth_gbs == 1935.0
    for pcie in (h100, a100):
        assert pcie.intra_node_gbs == 600 / 2           # the NVLink bridge of a pair, per direction
        assert "assumed" in pcie.source                  # inter-node: no DGX datasheet to quote


@pytest.mark.parametrize("dtype,peak", [(torch.bfloat16, 756.0), (torch.float16, 756.0), (torch.float32, 51.0)])
def test_a_known_gpu_s_peak_is_the_one_of_the_training_dtype(monkeypatch, dtype, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # no GPU here: its name is what CUDA would say
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert throughput.known_gpu_peak_tflops(dtype) == peak


def test_without_a_gpu_the_table_is_not_used():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert throughput.known_gpu_peak_tflops(torch.bfloat16) is None


def test_a_rate_is_measured_alone():
    assert throughput.measure_matmul_tflops(torch.float32, torch.device("cpu"), size=64, repeats=2) > 0


class MetaValuesReadAsOne(TorchDispatchMode):
    """A Python read of a meta tensor's value (.item()) answered with 1.0: meta tensors hold no values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return 1.0
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_the_measured_rate_is_averaged_over_the_world_on_the_run_s_device(fake_world):
    """The meta device stands in for a GPU: the rate's all-reduce must get a tensor on it, not on the CPU."""
    with MetaValuesReadAsOne(), CollectiveDevices() as collectives:
        rate = throughput.measure_matmul_tflops(torch.bfloat16, torch.device("meta"), size=64, repeats=1)
    assert collectives.ops == [("barrier", ["cpu"]), ("allreduce", ["meta"])]
    assert nccl_refusals(collectives.ops) == []
    assert rate == 1.0 / 2     # the sum read back, over the world of 2


def test_a_slow_16_bit_cpu_matmul_is_measured_small(monkeypatch):
    """Where the first small product says the full measurement would exceed its budget (16-bit on a CPU without
    16-bit matrix instructions: seconds per launch), the small product is what is measured; a fast one keeps its
    size."""
    sizes = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: sizes.append(a.shape[0]) or real(a, b))
    throughput.measure_matmul_tflops(torch.float32, torch.device("cpu"), size=512, repeats=2, budget_s=1e-9)
    assert set(sizes) == {throughput.PROBE_SIZE}
    sizes.clear()
    throughput.measure_matmul_tflops(torch.float32, torch.device("cpu"), size=512, repeats=2, budget_s=1e9)
    assert sizes[-3:] == [512, 512, 512]
