"""Collectives NCCL would refuse, found on a CPU run. NCCL, the backend on GPUs, takes only GPU tensors: a
collective given a CPU tensor (one made without device=, or brought back with .cpu()) fails there with "No
backend type associated with device type cpu", though gloo and the fake process group take it.

    with CollectiveDevices() as collectives:
        ...                                   # on gloo or the fake process group, tensors on the run's device
    problems = nccl_refusals(collectives.ops)
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# barrier's tensor is torch's own, made on the backend's device (CUDA under NCCL, CPU on gloo and fake)
_PLACEHOLDER_TENSOR = ("barrier",)


class CollectiveDevices(TorchDispatchMode):
    """Records each c10d op (allreduce, broadcast, send, ...) issued inside the block as (its name, the sorted
    device types of its tensor arguments), in order, from any caller."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self.ops.append((op_name(func), tensor_device_types(args, kwargs)))
        return func(*args, **kwargs)


def op_name(func):
    """c10d's name of the op, without the trailing _ of the in-place ones: allreduce, _allgather_base, send."""
    return func._schema.name.split("::")[1].rstrip("_")


def tensor_device_types(args, kwargs):
    return sorted({leaf.device.type for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)})


def nccl_refusals(ops):
    """A line for each recorded op NCCL would refuse: a collective or point-to-point op on a CPU tensor."""
    return [f"collective {name} on a CPU tensor: NCCL refuses it (make the tensor on the run's device)"
            for name, device_types in ops if "cpu" in device_types and name not in _PLACEHOLDER_TENSOR]
