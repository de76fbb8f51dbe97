"""megatron_ds.launch.devices: the device table, its lookups and the bandwidths derived from the
datasheet figures quoted beside each entry (NVLink totals are both directions; InfiniBand is one NIC per GPU)."""
import pytest

from megatron_ds.launch.devices import DEVICES, device_spec


def test_lookup_returns_the_table_entry():
    assert device_spec("h100-80gb") is DEVICES["h100-80gb"]
    assert device_spec("a100-40gb").name == "NVIDIA A100-SXM4-40GB"


def test_unknown_device_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown device 'v100'") as error:
        device_spec("v100")
    assert all(name in str(error.value) for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"))


def test_peak_depends_on_precision():
    h100 = device_spec("h100-80gb")
    assert h100.peak_tflops(sixteen_bit=True) == 989.0       # dense bf16 (1,979 is with sparsity)
    assert h100.peak_tflops(sixteen_bit=False) == 67.0


@pytest.mark.parametrize("name,nvlink_total_gbs,nic_gbits", [("a100-40gb", 600, 200), ("a100-80gb", 600, 200),
                                                             ("h100-80gb", 900, 400), ("h200", 900, 400)])
def test_link_bandwidths_are_per_direction_and_per_gpu(name, nvlink_total_gbs, nic_gbits):
    device = device_spec(name)
    assert device.intra_node_gbs == nvlink_total_gbs / 2      # 600 GB/s total -> 300 per direction
    assert device.inter_node_gbs == nic_gbits / 8             # 200 Gb/s HDR -> 25 GB/s, 400 Gb/s NDR -> 50


def test_a100_variants_differ_only_in_memory():
    small, large = device_spec("a100-40gb"), device_spec("a100-80gb")
    assert (small.memory_gib, large.memory_gib) == (40.0, 80.0)
    assert (small.memory_bandwidth_gbs, large.memory_bandwidth_gbs) == (1555.0, 2039.0)   # HBM2 vs HBM2e
    assert small.peak_tflops(True) == large.peak_tflops(True) and small.intra_node_gbs == large.intra_node_gbs
