"""pretrain.py with every rank counting, per training iteration, the operations that would make the host wait for
the GPU (a host sync) on a CUDA device, and where each comes from:

    torchrun --nproc_per_node 4 -m tests.support.host_syncs OUT_FOLDER <pretrain.py flags>

Each rank writes OUT_FOLDER/rank<R>.json: {"iterations": {iteration: {kind: count}}, "sites": {iteration:
[[kind, site, count], ...]}}. An iteration's window runs from begin_iteration(iteration) to the next one (the last:
to the end of train()), so it holds the iteration's logging and checks too.

A CPU-only run has its tensors on one device, so the counter keeps track of which tensors would be on the host on a
GPU machine ("host tensors"): those made from Python or NumPy data (torch.tensor / as_tensor / legacy constructors,
aten.lift_fresh) unless a device is given, those the DataLoader yields (pinned host memory on CUDA), the results of
.cpu() and of .to() with a device spelled "cpu" in the calling line, and whatever an op computes from host tensors
only. A device given by an expression (device(), self.device, get_accelerator()...) is the GPU. Where a GPU would
copy (to the host or to the GPU) but the CPU returns the same tensor, the counter returns a clone, as the GPU would.

Counted (kind: what), each only when its tensor is not a host tensor:
- item: aten._local_scalar_dense (.item(), float()/int()/bool() of a tensor, f"{tensor:.3f}", `if tensor:`);
- tolist: Tensor.tolist() (a blocking copy to the host; no op reaches the dispatcher on CPU, hence a wrap);
- nonzero, masked_select, equal (torch.equal answers a Python bool), unique (aten._unique, _unique2, unique_dim,
  unique_consecutive, unique_dim_consecutive), repeat_interleave (its Tensor overload without output_size);
- mask index: aten.index / index_put with a boolean index (tensor[mask], tensor[mask] = ...: a nonzero inside);
- download: .cpu() or .to("cpu") of a GPU tensor without non_blocking;
- upload: a host tensor .to(the GPU) without non_blocking, and torch.tensor / as_tensor of Python data with a GPU
  device (a copy from pageable memory that waits for the stream);
- copy: aten._to_copy / copy_ between a host and a GPU tensor (or two devices) without non_blocking.
Sites: the innermost frames of megatron_ds/ and deepspeed/ (up to three, innermost first).
"""
import functools
import json
import linecache
import os
import re
import sys
import traceback
from collections import Counter, defaultdict

import torch
import torch.utils.data.dataloader as dataloader
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

UNIQUE = {"_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"}
ALWAYS = {"_local_scalar_dense": "item", "nonzero": "nonzero", "masked_select": "masked_select", "equal": "equal",
          **{name: "unique" for name in UNIQUE}}
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
MASK_DTYPES = (torch.bool, torch.uint8)
SOURCES = (f"{os.sep}megatron_ds{os.sep}", f"{os.sep}deepspeed{os.sep}")
SITE_FRAMES = 3
HOST_LITERAL = re.compile(r"""['"]cpu['"]|\.cpu\(""")


def _tensors(tree):
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _site():
    frames = [frame for frame in traceback.extract_stack() if any(source in frame.filename for source in SOURCES)]
    if not frames:
        return "(outside megatron_ds and deepspeed)"
    innermost = reversed(frames[-SITE_FRAMES:])
    return " <- ".join(f"{_short(frame.filename)}:{frame.lineno} {frame.name}" for frame in innermost)


def _short(filename):
    for source in SOURCES:
        if source in filename:
            return source.strip(os.sep) + os.sep + filename.split(source, 1)[1]
    return filename


def _caller_names_host(depth=3):
    """Whether the line calling the wrapped function spells the host ("cpu", .cpu()); depth: its frame's, counted
    from here (here, the replacement, HostSyncCounter._wrap's wrapper, the caller)."""
    frame = sys._getframe(depth)
    return bool(HOST_LITERAL.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno)))


def _to_target(args, kwargs):
    """(device or None, other tensor or None, non_blocking) of a Tensor.to call."""
    target = kwargs.get("device")
    other = kwargs.get("other")
    positional = list(args)
    if positional and isinstance(positional[0], torch.Tensor):
        other = positional.pop(0)
    elif positional and isinstance(positional[0], (str, torch.device, int)):
        target = positional.pop(0)
    if positional and (positional[0] is None or isinstance(positional[0], torch.dtype)):
        positional.pop(0)  # .to(device, dtype, non_blocking, copy)
    non_blocking = positional[0] if positional else kwargs.get("non_blocking", False)
    return target, other, bool(non_blocking)


class HostSyncCounter(TorchDispatchMode):
    """Counts would-be host syncs per iteration (self.iteration; None: not counting) with their sites."""

    def __init__(self):
        super().__init__()
        self.iteration = None
        self.counts = defaultdict(Counter)  # iteration -> Counter[(kind, site)]
        self.host = WeakIdKeyDictionary()
        self._wraps = []

    # --- host tensors -------------------------------------------------------------------------------------

    def is_host(self, tensor):
        return isinstance(tensor, torch.Tensor) and tensor in self.host

    def mark(self, tree, host=True):
        for tensor in _tensors(tree):
            if host:
                self.host[tensor] = True
            else:
                self.host.pop(tensor, None)
        return tree

    def note(self, kind):
        if self.iteration is not None:
            self.counts[self.iteration][kind, _site()] += 1

    # --- the dispatcher's ops -----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._sync_kind(func, args, kwargs)
        if kind is not None:
            self.note(kind)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = _tensors((args, kwargs))
        if name == "lift_fresh" or (inputs and all(self.is_host(t) for t in inputs) and "device" not in kwargs):
            self.mark(out)
        return out

    def _sync_kind(self, func, args, kwargs):
        name = func.overloadpacket.__name__
        first = args[0] if args else None
        if name in ALWAYS:
            return None if self.is_host(first) else ALWAYS[name]
        if name == "repeat_interleave" and kwargs.get("output_size") is None:  # the .Tensor overload (repeats
            return None if self.is_host(first) else "repeat_interleave"  # alone); the others decompose into it
        if name in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            masks = [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in MASK_DTYPES]
            return "mask index" if any(not self.is_host(mask) for mask in masks) else None
        if name == "copy_":
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            differ = args[0].device != args[1].device or self.is_host(args[0]) != self.is_host(args[1])
            return "copy" if differ and not non_blocking else None
        if name == "_to_copy":
            target = kwargs.get("device")
            if target is not None and torch.device(target) != first.device and not kwargs.get("non_blocking"):
                return "copy"
        return None

    # --- the calls that reach no op on CPU, and the devices a CPU run cannot tell apart -----------------------

    def __enter__(self):
        self._wrap(torch.Tensor, "tolist", self._tolist)
        self._wrap(torch.Tensor, "cpu", self._cpu)
        self._wrap(torch.Tensor, "to", self._to)
        self._wrap(torch, "tensor", self._tensor)
        self._wrap(torch, "as_tensor", self._tensor)
        self._wrap(dataloader._BaseDataLoaderIter, "__next__", self._next_batch)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._wraps):
            setattr(owner, name, original)
        self._wraps.clear()
        return super().__exit__(*exc)

    def _wrap(self, owner, name, replacement):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):  # a function, so that a method wrapped on a class binds its instance
            return replacement(original, *args, **kwargs)

        setattr(owner, name, wrapped)
        self._wraps.append((owner, name, original))

    def _tolist(self, original, tensor, *args, **kwargs):
        if not self.is_host(tensor):
            self.note("tolist")
        return original(tensor, *args, **kwargs)

    def _cpu(self, original, tensor, *args, **kwargs):
        if self.is_host(tensor):
            return original(tensor, *args, **kwargs)
        self.note("download")
        return self._as_host(tensor, original(tensor, *args, **kwargs))

    def _as_host(self, source, result):
        """result (a host tensor), a copy where the CPU gave back the GPU tensor itself."""
        if result is source:
            result = source.clone()
        return self.mark(result)

    def _to(self, original, tensor, *args, **kwargs):
        target, other, non_blocking = _to_target(args, kwargs)
        if target is None and other is None:  # a dtype or memory format: where the tensor is
            return original(tensor, *args, **kwargs)
        to_host = self.is_host(other) if other is not None else _caller_names_host()
        result = original(tensor, *args, **kwargs)
        if to_host == self.is_host(tensor):
            return self.mark(result, to_host) if result is not tensor else result
        if not non_blocking:
            self.note("download" if to_host else "upload")
        if to_host:
            return self._as_host(tensor, result)
        if result is tensor:
            result = tensor.clone()
        return self.mark(result, host=False)

    def _tensor(self, original, data, *args, **kwargs):
        result = original(data, *args, **kwargs)
        device = kwargs.get("device")
        if device is None or _caller_names_host():
            return result
        if isinstance(data, torch.Tensor) and not self.is_host(data):
            return result  # already on the GPU
        self.note("upload")
        if result is data:
            result = data.clone()
        return self.mark(result, host=False)

    def _next_batch(self, original, iterator):
        return self.mark(original(iterator))

    def report(self):
        totals = {str(it): dict(sum((Counter({kind: n}) for (kind, _), n in sites.items()), Counter()))
                  for it, sites in sorted(self.counts.items())}
        sites = {str(it): [[kind, where, n] for (kind, where), n in sorted(sites.items())]
                 for it, sites in sorted(self.counts.items())}
        return {"iterations": totals, "sites": sites}


def install(out_folder):
    """Count in train() on this rank; write out_folder/rank<R>.json when it returns."""
    import torch.distributed as dist

    from megatron_ds.training import entry, loop
    train, begin_iteration = entry.train, loop.begin_iteration
    counter = HostSyncCounter()

    def counting_train(*args, **kwargs):
        try:
            with counter:
                return train(*args, **kwargs)
        finally:
            counter.iteration = None
            os.makedirs(out_folder, exist_ok=True)
            with open(os.path.join(out_folder, f"rank{dist.get_rank()}.json"), "w") as file:
                json.dump(counter.report(), file, indent=1)

    def noting_begin_iteration(parallel, engine, plan):
        counter.iteration = plan.iteration
        return begin_iteration(parallel, engine, plan)

    entry.train, loop.begin_iteration = counting_train, noting_begin_iteration
    return counter


if __name__ == "__main__":
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py
    install(sys.argv[1])
    from megatron_ds.training import pretrain
    sys.exit(pretrain(sys.argv[2:]))
