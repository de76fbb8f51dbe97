"""model_batch moves each micro-batch to the device without waiting for the copy: the loader pins its memory on
GPUs, and a blocking copy would stall the host once per micro-batch. The meta device stands in for a GPU: the
move to it is a real _to_copy, with the same arguments."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ds.arguments import parse_args
from megatron_ds.data.builder import model_batch
from tests.support.flags import TINY_MODEL


class DeviceCopies(TorchDispatchMode):
    """Records (source device, target device, non_blocking) of each aten._to_copy inside the block."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and "device" in kwargs:
            self.copies.append((args[0].device.type, kwargs["device"].type, kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("flags", [[], ["--eod-mask-loss"]], ids=["plain", "eod-mask-loss"])
def test_a_micro_batch_goes_to_the_device_without_a_host_wait(flags):
    data = parse_args(TINY_MODEL + flags).data
    tokens = torch.randint(0, data.vocab_size, (2, data.seq_length + 1))
    with DeviceCopies() as recorded:
        inputs, labels = model_batch(tokens, data, torch.device("meta"))
    assert recorded.copies == [("cpu", "meta", True)]
    assert inputs.device.type == "meta" and inputs.shape == (2, data.seq_length)
