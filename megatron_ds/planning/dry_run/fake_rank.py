"""Ranks of tools/dry_run.py, in a process of their own: pretrain.py's start-up (start_up) as rank R of
a world this machine does not have, on torch's fake process group (every collective returns at once, moving no
data) with the model built under FakeTensorMode (shapes and dtypes, no storage); DeepSpeed's own small tensors
stay real. For each rank it writes what the rank built as one JSON object, OUT_DIR/rank<R>.json:

    rank, coordinates      its place in the (pipe, data, seq, model) topology
    new_groups             the rank lists of every process group it created, in creation order (torch needs every
                           rank to create the same groups in the same order); with --digest only their count and
                           a SHA-256 of the sequence
    groups                 its groups by axis, ours (parallel_state) and DeepSpeed's pipeline grid's
    layers, parameters     transformer layers and parameters on this rank (start-up mode)
    bytes                  of its weights and of what its optimizer allocated at start-up (DeepSpeed's flat fp32
                           gradient buffer and master weights; the 16-bit gradients and Adam's moments come with
                           the first step)
    step, bytes_after_step with --step: one iteration's ops and allocation peak (planning/dry_run/fake_step.py), and the
                           bytes of the weights and optimizer after it

    python -m megatron_ds.planning.dry_run.fake_rank start-up|groups WORLD_SIZE GPUS_PER_NODE OUT_DIR [--digest] \
        -- <tools/dry_run.py flags>

The ranks come on stdin, one a line, as tools/dry_run.py hands them out (each of its --jobs workers pays the imports
once and takes the next rank when it is free); each rank done is answered on stdout by a line `fake_rank: done
rank R`.

start-up runs each rank in a child forked from this process once the imports are done (a fresh
process per rank, without its seconds of imports), the child's output in OUT_DIR/rank<R>.log: the whole
start-up.
groups runs each rank in turn in this process: only the process groups (initialize_groups) and
DeepSpeed's pipeline grid over them, the check --ranks all makes of every rank. Not run: data loading, the
watchdog, storage checks, the save-folder lock, TensorBoard. Both build the model with the reference fused ops
(the launch's --fusion-backend does not matter to shapes, and fake tensors go through no kernel); the optimizer
is the launch's.
"""
import contextlib
import dataclasses
import hashlib
import importlib
import io
import json
import os
import sys
import time
import traceback

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_ds.arguments.resolve import replaced
from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.transformer.fused_ops import cuda_op_backend, runs_flash_attention
from megatron_ds.core.transformer.transformer_layer import TransformerLayer
from megatron_ds.planning.dry_run.fake_step import run_step
from megatron_ds.planning.dry_run.launch_check import DONE, FAKE_RANK_DEVICE_ENVIRONMENT, resolve_flags
from megatron_ds.training import initialize


def _environment(rank, world_size, gpus_per_node):
    """What a launcher would export for `rank`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % gpus_per_node),
                      LOCAL_WORLD_SIZE=str(gpus_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                      **FAKE_RANK_DEVICE_ENVIRONMENT)


@contextlib.contextmanager
def recorded_new_groups(calls):
    """Every torch.distributed.new_group call's ranks appended to `calls` (None: the whole world)."""
    original = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        calls.append(None if ranks is None else [int(rank) for rank in ranks])
        return original(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


@contextlib.contextmanager
def moves_in_place_skipped():
    """Module.to to the device and dtype the module already has returns it untouched, and one of FakeTensor
    parameters converts their data in place: torch 2.13 swaps each FakeTensor parameter for a copy, and cannot
    (the fake mode keeps weak references to them). DeepSpeed's GroupedExperts, made in fp32, goes to bf16 so."""
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = list(module.parameters()) + list(module.buffers())
        if all((device is None or tensor.device == device) and
               (dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype) for tensor in tensors):
            return module
        if any(isinstance(param, FakeTensor) for param in module.parameters()):
            return _converted_in_place(module, device, dtype)
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def _converted_in_place(module, device, dtype):
    """Module.to(device, dtype) for fake tensors: each parameter keeps its object (its data replaced), each
    buffer is replaced; integer tensors keep their dtype."""
    for param in module.parameters():
        param.data = param.data.to(device=device, dtype=dtype if param.is_floating_point() else None)
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            owner._buffers[name] = buffer.to(device=device, dtype=dtype if buffer.is_floating_point() else None)
    return module


def _storage_bytes(tensors):
    """Bytes of the distinct storages under `tensors` (views of one flat buffer count once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return storages


def _tensors_in(value, depth=0):
    """The tensors an optimizer object holds in its attributes, lists and dicts (a few levels deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif depth == 0 and hasattr(value, "__dict__"):
        for name, item in vars(value).items():
            if not name.startswith("__"):
                yield from _tensors_in(item, depth + 1)


def allocated_bytes(engine):
    """{'weights': the module's parameters, 'optimizer': the storages the optimizer holds beside theirs} in
    bytes (DeepSpeed makes the 16-bit parameters views of its flat buffers)."""
    parameters = {id(param): param for param in engine.module.parameters()}.values()
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    held = list(_tensors_in(optimizer)) + (list(_tensors_in(inner.state)) if inner is not None else [])
    weights = _storage_bytes(parameters)
    others = {key: size for key, size in _storage_bytes(held).items() if key not in weights}
    return {"weights": sum(param.numel() * param.element_size() for param in parameters),
            "optimizer": sum(others.values())}


def tied_ranks(engine):
    """The ranks of DeepSpeed's group that sums this rank's tied embedding's gradients across pipeline stages
    (None: no such group, the embeddings untied or PP 1)."""
    for comm in getattr(engine.module, "tied_comms", {}).values():
        if len(comm["ranks"]) > 1:
            return comm["ranks"]
    return None


def groups_by_axis(grid, args, rank, tied=None):
    """This rank's groups, ours (with CP the context-parallel group, with MoE the expert and expert-data groups
    too; `tied`: DeepSpeed's tied embedding's, where there is one) and (PP > 1) DeepSpeed's pipeline grid's."""
    ours = {"tensor": parallel_state.get_tensor_model_parallel_ranks(),
            "data": parallel_state.get_data_parallel_ranks(),
            "pipeline": parallel_state.get_pipeline_model_parallel_ranks(),
            "sequence": parallel_state.get_sequence_parallel_ranks(),
            "sequence-data": parallel_state.get_sequence_data_parallel_ranks()}
    if args.context_parallel_size > 1:
        ours["context"] = parallel_state.get_context_parallel_ranks()
    if args.moe or args.dropless_moe:
        for axis, groups in parallel_state.expert_groups_by_axis(args.moe_expert_parallel_size,
                                                                 args.parallel.expert_tensor_parallel).items():
            ours[axis] = next(ranks for ranks in groups if rank in ranks)
    if tied is not None:
        ours["tied"] = tied
    theirs = None if grid is None else {"data": list(grid.dp_group), "pipeline": list(grid.pp_group),
                                        "tensor": list(grid.slice_group)}
    return {"ours": {axis: [int(rank) for rank in ranks] for axis, ranks in ours.items()}, "deepspeed": theirs}


def run_rank(rank, world_size, args):
    """Start rank `rank` up on the fake backend; its record (the module docstring's fields)."""
    start = time.perf_counter()
    calls = []
    with recorded_new_groups(calls), moves_in_place_skipped():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        engine, _ = initialize.start_up(args, building_model=lambda: FakeTensorMode(allow_non_fake_inputs=True))
    parameters = {id(p): p.numel() for p in engine.module.parameters()}
    record = {**_placement(rank, calls), "groups": groups_by_axis(getattr(engine, "grid", None), args, rank,
                                                                  tied_ranks(engine)),
              "layers": sum(isinstance(module, TransformerLayer) and module.layer_number <= args.num_layers
                            for module in engine.module.modules()),  # an MTP module's layer is not one of them
              "parameters": sum(parameters.values()), "bytes": allocated_bytes(engine)}
    if args.step:
        record["step"] = run_step(engine, args, args.micro_batches)
        record["bytes_after_step"] = allocated_bytes(engine)
    return {**record, "seconds": time.perf_counter() - start}


def group_rank(rank, world_size, args):
    """Only rank `rank`'s process groups and DeepSpeed's pipeline grid (PP > 1) over the same topology, then
    everything torn down for the next rank of this process."""


    calls = []
    with recorded_new_groups(calls):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        initialize.initialize_groups(args)
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0's grid prints every rank's coordinates
            grid = (PipelineParallelGrid(topology=parallel_state.deepspeed_topology())
                    if args.pipeline_model_parallel_size > 1 else None)
    record = {**_placement(rank, calls), "groups": groups_by_axis(grid, args, rank)}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return record


def _placement(rank, calls):
    return {"rank": rank, "coordinates": parallel_state.get_topology().get_coord(rank)._asdict(),
            "new_groups": calls}


def digested(record):
    """The record with its group sequence as a count and a SHA-256 (--ranks all: thousands of ranks)."""
    calls = record.pop("new_groups")
    record["new_groups_count"] = len(calls)
    record["new_groups_digest"] = hashlib.sha256(json.dumps(calls).encode()).hexdigest()
    return record


def _with_reference_model_ops(args):
    """The model's fused ops as their references: fake tensors go through no kernel, and torch.compile of fake
    tensors costs minutes. Attention stays on the path a GPU would take (the flash_attention op, which saves
    other tensors than sdpa's kernels, where the GPU would run it). The optimizer stays the launch's: a fused
    AdamW makes no temporaries, the for-loop one (--fusion-backend reference) makes them on a GPU too."""
    model = args.model
    attention = "flash" if runs_flash_attention(model, cuda_op_backend) else model.attention_backend
    return replaced(args, model=dataclasses.replace(model, fusion_backend="reference", attention_backend=attention))


def main(argv):
    mode, world_size, gpus_per_node, folder = argv[0], int(argv[1]), int(argv[2]), argv[3]
    digest = "--digest" in argv[4:argv.index("--")]
    flags = argv[argv.index("--") + 1:]
    _environment(0, world_size, gpus_per_node)
    deepspeed_internals.skip_shared_memory_comm_build()
    args = _with_reference_model_ops(resolve_flags(flags))
    for index, rank in enumerate(int(line) for line in sys.stdin):
        _environment(rank, world_size, gpus_per_node)
        if mode == "groups":
            record = group_rank(rank, world_size, args)
            _write(os.path.join(folder, f"rank{rank}.json"), digested(record) if digest else record)
        else:
            modules = os.path.join(folder, f"rank{rank}.modules") if index == 0 else None
            in_child(lambda: _start_up_rank(rank, world_size, args, folder, modules),
                     os.path.join(folder, f"rank{rank}.log"))
            if modules is not None and os.path.exists(modules):
                _import_listed(modules)
        print(f"{DONE}{rank}", flush=True)
    return 0


def _start_up_rank(rank, world_size, args, folder, modules):
    _write(os.path.join(folder, f"rank{rank}.json"), run_rank(rank, world_size, args))
    if modules is not None:
        with open(modules, "w") as handle:
            handle.write("\n".join(sorted(sys.modules)))


def in_child(work, log_path):
    """work() in a forked child, its output to log_path; its exit code. Each rank starts from this process's
    state (imports done, no process group, no model), as a fresh process would, without the imports' seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            work()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _import_listed(path):
    """The modules a first rank imported on the way (DeepSpeed imports many lazily), so that later ranks' children
    find them loaded."""
    with open(path) as handle:
        names = handle.read().split()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for name in names:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # an alias or a module only its importer can load: the child imports it again
                    pass


def _write(path, record):
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(record, handle)
    os.replace(temporary, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
