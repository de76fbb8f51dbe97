"""One training iteration of a dry-run rank (tools/dry_run.py --step), after its start-up (dry_run/fake_rank.py):
DeepSpeed's engine.train_batch on a micro-batch of zeros, repeated, then the step's FP8 delayed-scaling update (if
any), on the fake process group, with every
collective and point-to-point op the rank issues recorded as it reaches the process group (ours, DeepSpeed's,
from any caller) and the bytes of the tensors the iteration allocates followed to their peak.

A fake backend moves no data, and a dry-run rank holds fake tensors (shapes, no values). Three things a real
iteration reads back are answered instead:
  - the integer messages of DeepSpeed's pipeline (the shapes of what a stage receives, the layout of a message
    split over TP) with what the previous stage sends for this layout (deepspeed_internals.
    pipeline_integer_messages of gpt_model.activation_between_stages); both ends record the values, and the
    dry run checks every receive against its sender's send;
  - a fake tensor's value read in Python (the loss's .item(), the overflow and gradient-norm checks) as 0;
  - the dropless MoE layer's per-expert counts (the splits of its all-to-alls) with uniform routing: each rank's
    k x tokens rows spread evenly over the experts, the remainder on the first ones, and every rank receiving the
    counts it sends (AllToAllDispatcher.uniform_routing), what the planner plans;
  - the dropout's keep-masks, made without hashing (core/fusions/dropout.hashes_keep_masks): a fake tensor has no
    values, and the fused kernels make no hash temporaries either.
Context-parallel attention runs its ring (or all-gather) on the fake tensors, so that its sends are recorded; its
blocks take the CPU flash kernel's fake, which keeps no s x s scores.

Each op: {"op": c10d's name (allreduce, _allgather_base, send, recv, ...), "group": its ranks, "peer": the
other rank (send and recv), "bytes": the payload (the whole buffer of a reduction or gather, the message of a
point-to-point op), "sent": what this rank puts on the wire for it under the ring model of
planning/communication.py (an all-to-all with uneven splits: all but its own split), "splits": an all-to-all-v's
rows to each rank of its group, "values": the integers of an integer message}.
"""
import itertools
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_ds.checkpointing import TrainingProgress
from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.fusions import dropout as dropout_masks
from megatron_ds.core.models.gpt.gpt_model import activation_between_stages
from megatron_ds.core.tensor_parallel.fp8_delayed import delayed_scalings, update_delayed_scales
from megatron_ds.core.transformer.dropless_moe import AllToAllDispatcher, stage_token_groups
from megatron_ds.data.builder import model_batch
from megatron_ds.planning import communication as comm
from megatron_ds.training import loop
from megatron_ds.training.iteration_plan import plan_iteration

# what each rank sends per op of `payload` bytes over n ranks; every other op sends the payload to its peer
_SENT = {"allreduce": comm.all_reduce_bytes, "allreduce_coalesced": comm.all_reduce_bytes,
         "_allgather_base": comm.all_gather_bytes, "allgather": comm.all_gather_bytes,
         "allgather_into_tensor_coalesced": comm.all_gather_bytes, "_reduce_scatter_base": comm.all_gather_bytes,
         "reduce_scatter": comm.all_gather_bytes, "reduce_scatter_tensor_coalesced": comm.all_gather_bytes,
         "alltoall": comm.all_to_all_bytes, "alltoall_base": comm.all_to_all_bytes,
         "broadcast": comm.all_gather_bytes, "barrier": lambda ranks, payload: 0.0, "recv": lambda ranks, payload: 0.0}
# the argument whose tensors are the payload (the whole buffer): a gather's output, a scatter's input
_PAYLOAD = {"_allgather_base": "output_tensor", "allgather": "output_tensors",
            "allgather_into_tensor_coalesced": "outputs", "_reduce_scatter_base": "input_tensor",
            "reduce_scatter": "input_tensors", "reduce_scatter_tensor_coalesced": "inputs",
            "alltoall": "input_tensors", "alltoall_base": "input", "barrier": None}


class StepRecorder(TorchDispatchMode):
    """Records the ops (the module docstring's form) and the peak of the bytes allocated inside the block;
    answers integer receives from `answers` ({dtype: values}) and Python reads of fake values with 0. A tensor
    made from nothing (torch.empty, zeros, ...) is made fake in `fake_mode` unless it holds integers (the
    pipeline's messages, token ids): a real dropout mask of a 530B layer costs a second to draw."""

    def __init__(self, answers, fake_mode):
        super().__init__()
        self.answers, self.fake_mode, self.ops = answers, fake_mode, []
        self.live = {}            # storage -> (allocation number, bytes)
        self.events = []          # (allocation number, +bytes when made, -bytes when freed), in order
        self.live_bytes = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # most of the ops an iteration dispatches: nothing to follow
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 0
        if _makes_real_values(func, args, kwargs):
            with self.fake_mode:
                result = func(*args, **kwargs)
        else:
            result = func(*args, **kwargs)
        if func.namespace == "c10d":
            self._record(func, args, kwargs)
        self._follow(result, args, kwargs)
        return result

    def _record(self, func, args, kwargs):
        named = _named_arguments(func, args, kwargs)
        group = dist.ProcessGroup.unbox(named["process_group"])
        ranks = dist.get_process_group_ranks(group)
        op = func._schema.name.split("::")[1].rstrip("_")
        payload = sum(_bytes(tensor) for tensor in tree_leaves(named.get(_PAYLOAD.get(op, "tensors"), [])))
        entry = {"op": op, "group": ranks, "bytes": payload,
                 "sent": _SENT.get(op, lambda n, p: p)(len(ranks), payload)}
        splits = list(named.get("input_split_sizes") or []) if op == "alltoall_base" else []
        if splits:  # an all-to-all-v (the dropless MoE layer's): all but the rows it keeps
            entry["splits"] = splits
            entry["sent"] = payload * (1 - splits[ranks.index(dist.get_rank())] / max(sum(splits), 1))
        if op in ("send", "recv"):
            entry["peer"] = ranks[named["dst" if op == "send" else "src"]]
            tensor = named["tensors"][0]
            if not tensor.is_floating_point():
                if op == "recv":
                    _fill(tensor, self.answers.get(tensor.dtype, []))
                entry["values"] = deepspeed_internals.integer_message_values(tensor)
        self.ops.append(entry)

    def _follow(self, result, args, kwargs):
        """Counts each new storage an op returns (not the inputs' own: in-place ops and views) until it dies.
        A storage's Python object lives exactly as long as the storage (PyTorch preserves it), where a tensor's
        does not: autograd saves an output for backward as another tensor on the same storage."""
        inputs = {_storage_key(tensor) for tensor in tree_leaves((args, kwargs)) if isinstance(tensor, torch.Tensor)}
        for tensor in tree_leaves(result):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.live:
                continue
            self.live[key] = (len(self.events), storage.nbytes())
            self.events.append(self.live[key])
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._release, key)

    def _release(self, key):
        number, size = self.live.pop(key)
        self.events.append((number, -size))
        self.live_bytes -= size

    def transient_peak_bytes(self):
        """The peak of the bytes of the storages that died before now: what an iteration needs beyond what it
        keeps (the first one makes Adam's moments, which later iterations find made)."""
        kept = {number for number, _ in self.live.values()}
        current = peak = 0
        for number, change in self.events:
            if number not in kept:
                current += change
                peak = max(peak, current)
        return peak


def _makes_real_values(func, args, kwargs):
    """A factory (no tensor in) of a floating-point or bool tensor."""
    if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves((args, kwargs))):
        return False
    dtype = _factory_dtype(func, args, kwargs)
    return dtype.is_floating_point or dtype == torch.bool


def _factory_dtype(func, args, kwargs):
    """Its dtype argument, else the default dtype, but for arange of integers (int64: the dropless MoE layer's
    row orders)."""
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    if func.overloadpacket is torch.ops.aten.arange and not any(isinstance(arg, float) for arg in args):
        return torch.int64
    return torch.get_default_dtype()


def _named_arguments(func, args, kwargs):
    named = {argument.name: value for argument, value in zip(func._schema.arguments, args)}
    return {**named, **kwargs}


def _bytes(tensor):
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _storage_key(tensor):
    return tensor.untyped_storage()._cdata


def _fill(tensor, values):
    tensor.zero_()
    count = min(len(values), tensor.numel())
    tensor.view(-1)[:count] = torch.tensor(values[:count], dtype=tensor.dtype)


def run_step(engine, args, micro_batches=None):
    """One train_batch of `micro_batches` (default: the first iteration's, the ramp-up's first batch) on this
    rank; its ops, peak bytes and micro-batches."""

    plan = plan_iteration(1, TrainingProgress(), args.optimization.batch_schedule, args.micro_batch_size,
                          args.data_parallel_size, args.seq_length)
    if micro_batches is not None:
        samples = micro_batches * args.micro_batch_size * args.data_parallel_size
        plan = type(plan)(1, samples, micro_batches, plan.seq_length, 0, 0)
    tokens = torch.zeros(args.micro_batch_size, args.seq_length + 1, dtype=torch.long)
    batch = model_batch(tokens, args.data, torch.device("cpu"))
    answers = {}
    if args.pipeline_model_parallel_size > 1:
        activation = activation_between_stages(args.model, batch[0],
                                               parallel_state.get_tensor_model_parallel_world_size())
        answers = deepspeed_internals.pipeline_integer_messages(engine, activation)
    loop.begin_iteration(args.parallel, engine, plan)
    AllToAllDispatcher.uniform_routing = True
    dropout_masks.hashes_keep_masks = False
    recorder = StepRecorder(answers, next(engine.module.parameters()).fake_mode)
    with recorder:
        loop.run_global_batch(engine, itertools.repeat(batch), plan.micro_batches, train=True)
        update_delayed_scales(delayed_scalings(engine.module), stage_token_groups())
    return {"micro_batches": plan.micro_batches, "ops": recorder.ops, "peak_bytes": recorder.peak_bytes,
            "held_bytes": recorder.live_bytes, "transient_peak_bytes": recorder.transient_peak_bytes()}
