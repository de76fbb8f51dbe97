"""RNG states for tensor-parallel regions, and deterministic full-model initialization.

Dropout inside a TP region (attention probabilities of this rank's heads) must differ per TP rank;
dropout in replicated regions must be identical on every TP rank. The tracker keeps a separate
generator state, seeded per TP rank, and `fork()` swaps it in. It works on CPU and CUDA: it swaps the
state of the generator that drives the current device.

DeepSpeed's activation checkpointing (`use_deepspeed_checkpointing`, as Megatron-DeepSpeed's
--deepspeed-activation-checkpointing): `checkpoint` runs deepspeed.checkpointing.checkpoint and
`get_cuda_rng_tracker` returns DeepSpeed's tracker, the one its checkpoint saves and restores around a
recompute; the seeds stay ours, so dropout masks are the same as with our own checkpoint.
"""
import contextlib
import hashlib

import torch

from megatron_ds.core.parallel_state import (
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron_ds.core.tensor_parallel.mappings import gather_along_tensor_parallel

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _device_rng_state():
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_device_rng_state(state):
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed_device(seed):
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states; `fork(name)` runs a block under that state and saves its advance."""

    def __init__(self):
        self.states = {}

    def reset(self):
        self.states = {}

    def get_states(self):
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states):
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _device_rng_state()
        _manual_seed_device(seed)
        self.states[name] = _device_rng_state()
        _set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not added; call model_parallel_cuda_manual_seed(seed) first")
        saved = _device_rng_state()
        _set_device_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _device_rng_state()
            _set_device_rng_state(saved)


_TRACKER = RNGStatesTracker()
_deepspeed_checkpointing = None  # the deepspeed.checkpointing module while use_deepspeed_checkpointing() is on


def get_cuda_rng_tracker():
    """The process-wide tracker (Megatron's name; it serves CPU and CUDA alike): ours, or DeepSpeed's while
    use_deepspeed_checkpointing() is on (same methods: reset, add, fork, get_states, set_states)."""
    if _deepspeed_checkpointing is not None:
        return _deepspeed_checkpointing.get_cuda_rng_tracker()
    return _TRACKER


def use_deepspeed_checkpointing(enabled=True):
    """Route `checkpoint` and `get_cuda_rng_tracker` to DeepSpeed's activation checkpointing (configured first
    with deepspeed.checkpointing.configure), or back to ours. The tracker's states move to the one now active,
    so the switch may come before or after model_parallel_cuda_manual_seed."""
    global _deepspeed_checkpointing
    from deepspeed.runtime.activation_checkpointing import checkpointing as deepspeed_checkpointing
    if enabled and not deepspeed_checkpointing.is_configured():
        raise RuntimeError("call deepspeed.checkpointing.configure(mpu, ...) before use_deepspeed_checkpointing()")
    states = get_cuda_rng_tracker().get_states()
    _deepspeed_checkpointing = deepspeed_checkpointing if enabled else None
    tracker = get_cuda_rng_tracker()
    tracker.reset()  # DeepSpeed's also forgets the seeds it refuses to see twice
    tracker.set_states({name: state.clone() for name, state in states.items()})


def model_parallel_cuda_manual_seed(seed: int):
    """Seed the default generator identically on every TP rank of a stage (replicated regions) and the
    tracker's model-parallel generator differently per TP rank (tensor-parallel regions)."""
    default_seed = seed + 100 * get_pipeline_model_parallel_rank()
    torch.manual_seed(default_seed)
    _manual_seed_device(default_seed)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, default_seed + 2718 + get_tensor_model_parallel_rank())


def _generator_for(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def init_method_normal(std: float):
    """Fill a full (unsharded) fp32 tensor from N(0, std) with the given generator."""
    def init_(tensor, generator):
        return tensor.normal_(0.0, std, generator=generator)
    return init_


def set_init_method(param: torch.nn.Parameter, init_method):
    param.init_method = init_method


def _shard_of_full(full, param):
    """This rank's shard of a full tensor, honouring `partition_dim` and `partition_stride`."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    stride_blocks = full.chunk(param.partition_stride, dim=param.partition_dim)
    return torch.cat([block.chunk(world, dim=param.partition_dim)[rank] for block in stride_blocks],
                     dim=param.partition_dim)


def full_shape(param):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= get_tensor_model_parallel_world_size()
    return shape


@torch.no_grad()
def initialize_deterministically(module: torch.nn.Module, prefix: str, seed: int):
    """Initialize every parameter that carries an `init_method`: draw the full tensor from a generator
    seeded by (seed, prefix.name), then keep this rank's shard. The same seed therefore gives the same
    full model for every (tp, pp, dp) layout. A parameter whose module path depends on the layout carries its
    own layout-free `init_key` instead (an MoE expert: its global index, whatever the expert-parallel size), or
    `init_keys`, one per slice along the first dim (grouped experts: one expert each)."""
    for name, param in module.named_parameters():
        init_method = getattr(param, "init_method", None)
        if init_method is None or param.is_meta:  # meta: shapes only (planning), nothing to fill
            continue
        full = torch.empty(full_shape(param), dtype=torch.float32)
        keys = getattr(param, "init_keys", None)
        for part, key in zip(full if keys else [full], keys or [getattr(param, "init_key", f"{prefix}.{name}")]):
            init_method(part, _generator_for(seed, key))
        param.copy_(_shard_of_full(full, param))


def _rng_snapshot():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def _restore_rng(snapshot):
    torch.set_rng_state(snapshot["cpu"])
    if snapshot["cuda"] is not None:
        torch.cuda.set_rng_state(snapshot["cuda"])
    get_cuda_rng_tracker().set_states(snapshot["tracker"])


def _split_for_this_rank(tensor):
    """This TP rank's contiguous 1/t of a tensor's elements (flattened)."""
    flat = tensor.reshape(-1)
    return flat.chunk(get_tensor_model_parallel_world_size())[get_tensor_model_parallel_rank()].clone()


def _gather_split(shard, shape):
    return gather_along_tensor_parallel(shard, 0)[: torch.Size(shape).numel()].view(shape)


class _CheckpointFunction(torch.autograd.Function):
    """Run `function` without saving activations; in backward, restore the RNG states of the forward (the
    default generators and the TP tracker, so dropout masks repeat), recompute and backpropagate.
    distribute_saved_activations: keep only this TP rank's 1/t of the first input (all-gathered back in
    backward); for inputs replicated across TP, as the layer input is without sequence parallelism."""

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, *args):
        ctx.function = function
        ctx.rng = _rng_snapshot()
        with torch.no_grad():
            outputs = function(*args)
        ctx.inputs_need_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.distributed_shape = None
        if distribute_saved_activations and get_tensor_model_parallel_world_size() > 1:
            ctx.distributed_shape = args[0].shape
            args = (_split_for_this_rank(args[0]), *args[1:])
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.others)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[position] = tensor
        if ctx.distributed_shape is not None:
            args[0] = _gather_split(args[0], ctx.distributed_shape)
        inputs = [a.detach().requires_grad_(needs) if torch.is_tensor(a) else a
                  for a, needs in zip(args, ctx.inputs_need_grad)]
        current = _rng_snapshot()
        _restore_rng(ctx.rng)
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        _restore_rng(current)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in inputs))


def checkpoint(function, distribute_saved_activations, *args):
    """Activation recompute (Megatron's tensor_parallel.checkpoint); function returns a tensor or a tuple.
    While use_deepspeed_checkpointing() is on, DeepSpeed's checkpoint does it, with the options given to
    deepspeed.checkpointing.configure (partition_activations replaces distribute_saved_activations)."""
    if _deepspeed_checkpointing is not None:
        return _deepspeed_checkpoint(function, args)
    return _CheckpointFunction.apply(function, distribute_saved_activations, *args)


def _deepspeed_checkpoint(function, args):
    if not torch.is_grad_enabled():
        # nothing to recompute without a backward; and DeepSpeed's contiguous buffers are only freed by one
        return function(*args)
    # only tensors go through DeepSpeed: with partition_activations it puts each non-tensor argument back twice
    positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
    others = [None if torch.is_tensor(a) else a for a in args]

    def run(*tensors):
        full = list(others)
        for position, tensor in zip(positions, tensors):
            full[position] = tensor
        return function(*full)

    return _deepspeed_checkpointing.checkpoint(run, *(args[i] for i in positions))
