"""Compile every Triton kernel the fused ops launch (forward and backward) for an NVIDIA GPU without one, and print
each kernel's registers, spills and shared memory: a kernel that fails to compile for Hopper, spills or needs more
shared memory than the target has shows in CI, not on the lent machine.

    python bench/triton_sm90.py [--size large|tiny|...] [--arch 90] [--dtype bf16|fp32] [--ops swiglu ...]

How: each op's own triton backend runs bench/ops.py's case at --size (forward, then backward) on meta tensors
(shapes only: no memory, no arithmetic), so its own launch code picks grids, tiles and constexprs, with
- a stand-in for triton's active driver answering what JITFunction.run and the compiler ask it: device 0, stream 0
  and the target GPUTarget("cuda", arch, 32);
- `kernel[grid](...)` run as JITFunction.run(..., warmup=True): compiled through triton's whole pipeline (TTIR,
  TTGIR, LLVM IR, PTX, and the cubin by the ptxas triton bundles), never launched;
- the launch code's device-dependent choices (gpu_choices below: check_device, parallel_programs, row_programs,
  flash_attention._meta, dropout.hash_chunk_elements) answered as on a CUDA device, so that the kernels get the
  GPU's tiles and constexprs, not the interpreter's; the script refuses to run if a fusion module compares with
  "cuda" anywhere else.
Meta tensors' data_ptr() is 0, so pointer arguments specialize as 16-byte aligned, as fresh CUDA allocations do.
Registers and spills: triton fills n_regs/n_spills only when it loads a binary on a device, so the kernel's PTX goes
through triton's own make_cubin again (ptxas with the flags this triton uses) with its `ptxas -v` log kept.
Kernels are found in triton's cache (TRITON_CACHE_DIR) when compiled before; ptxas runs again either way.

The kernels are those bench/ops.py's cases launch, with their constexprs (bf16; GELU erf with bias, dropout 0.1 in
bias_dropout_add and flash attention, LayerNorm with bias, RMSNorm without): other variants are not compiled.

Columns: phase (fwd/bwd), warps, stages, constexprs, regs (per thread), spill stores/loads and stack frame in bytes
(per thread), smem (dynamic shared memory per program, bytes), launches, compile seconds. SPILLS marks a kernel
with spill stores or loads (reported, not failed).

Exit status: 0 every kernel compiled, within the target's shared memory; 1 a kernel failed to compile or exceeds the
target's shared memory, an op's launch code failed, or a kernel of megatron_ds/core/fusions was launched by no case
(each said on a line of its own); 3 this triton cannot compile for the target on this machine (no triton, no NVIDIA
backend or runnable ptxas, or a probe kernel of this script does not compile through the stand-in): one line starting
"cannot compile for sm_<arch> here:" says why; 2 a usage error.
"""
import argparse
import ast
import contextlib
import inspect
import io
import os
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CANNOT = 3  # exit status: this triton cannot compile for the target here
# The largest dynamic shared memory one program may use, bytes (CUDA C Programming Guide, compute capabilities table)
MAX_SHARED = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
              120: 101376}
# SMs of the card the lent machines have per arch (H100 SXM: 132); only the persistent kernels' grids depend on it
SMS = {80: 108, 90: 132, 100: 148}


class CannotCompileHere(Exception):
    """This triton cannot compile for the target on this machine; the message says why."""


class StandInDriver:
    """What triton's launch path (JITFunction.run, triton.compile) asks the active driver, answered for `target`
    without a device. It cannot load or launch a kernel: anything else it is asked fails, naming what was asked."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")

    def is_active(self):
        return True

    def __getattr__(self, name):
        raise AttributeError(f"the stand-in driver has no {name!r} (this triton asks the driver for more than the "
                             f"current device, stream and target)")


# ---------------------------------------------------------------------------------------------------------------
# the launch code's device-dependent choices, answered as on the target GPU

def gpu_choices(arch):
    """{(module, name): replacement} for the fusion helpers that choose by device type: the choice a CUDA device
    gets (the originals called with a CUDA device where they take one)."""
    from megatron_ds.core.fusions import _triton, dropout, flash_attention
    cuda = torch.device("cuda")
    row_programs, meta, chunk = _triton.row_programs, flash_attention._meta, dropout.hash_chunk_elements

    def check_device(*tensors, op):  # meta tensors stand for CUDA ones
        return None

    def parallel_programs(device, per_sm=4):
        return SMS.get(arch, 132) * per_sm

    return {
        (_triton, "check_device"): check_device,
        (_triton, "parallel_programs"): parallel_programs,
        (_triton, "row_programs"): lambda rows, block_m, device: row_programs(rows, block_m, cuda),
        (flash_attention, "_meta"): lambda threshold, device, d, e=None: meta(threshold, cuda, d, e),
        (dropout, "hash_chunk_elements"): lambda device: chunk(cuda),  # plain PyTorch's dropout: no kernel
    }


def unanswered_device_choices(answered):
    """Functions of megatron_ds/core/fusions (backend selection aside) that compare with "cuda" and that GPU_CHOICES
    does not answer: a new device-dependent launch choice, which this script would otherwise make as on a CPU."""
    names = {f"{module.__name__.rsplit('.', 1)[-1]}.{name}" for module, name in answered}
    found = []
    for path in sorted((REPO / "megatron_ds" / "core" / "fusions").glob("*.py")):
        if path.name == "backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(leaf, ast.Constant) and leaf.value == "cuda" for leaf in ast.walk(node)):
                if f"{path.stem}.{node.name}" not in names:
                    found.append(f"{path.stem}.{node.name}")
    return found


@contextlib.contextmanager
def patched(choices):
    """Each choice replaced in every fusion module that binds the original (`from _triton import ...` copies)."""
    from megatron_ds.core import fusions
    modules = [module for name, module in sys.modules.items()
               if name.startswith(fusions.__name__ + ".") and module is not None]
    saved = []
    for (home, name), replacement in choices.items():
        original = getattr(home, name)
        for module in modules:
            if module.__dict__.get(name) is original:
                saved.append((module, name, original))
                setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


# ---------------------------------------------------------------------------------------------------------------
# compiling instead of launching, and ptxas's figures

class Compiler:
    """Every `kernel[grid](...)` becomes JITFunction.run(..., warmup=True); each distinct compiled kernel of an op
    is reported once, with its ptxas figures."""

    def __init__(self, target, backend):
        self.target, self.backend = target, backend
        self.op, self.phase = None, None
        self.rows = {}        # (op, kernel hash) -> row dict
        self.failures = []    # lines
        self.launched = set()  # JIT function names launched (compiled or not)

    @contextlib.contextmanager
    def compile_only(self):
        from triton.runtime.jit import JITFunction
        had_own = "__getitem__" in JITFunction.__dict__
        original = JITFunction.__dict__.get("__getitem__")
        JITFunction.__getitem__ = lambda jit, grid: (lambda *args, **kwargs: self.launch(jit, grid, args, kwargs))
        try:
            yield
        finally:
            if had_own:
                JITFunction.__getitem__ = original
            else:
                del JITFunction.__getitem__

    def launch(self, jit, grid, args, kwargs):
        name = jit.fn.__name__
        self.launched.add(f"{jit.fn.__module__}.{name}")
        constexprs = _constexprs(jit, args, kwargs)
        began = time.perf_counter()
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):  # a failing ptxas prints the whole PTX; the error says enough
                compiled = jit.run(*args, grid=grid, warmup=True, **kwargs)
                if hasattr(compiled, "result"):  # a future, when triton compiles asynchronously
                    compiled = compiled.result()
        except Exception as error:  # every compile error is a finding; the op's other kernels still compile
            self._fail(f"{self.op} {name} ({self.phase}, {_words(constexprs)}) FAILED to compile for "
                       f"sm_{self.target.arch}: {type(error).__name__}: {_first_lines(str(error))}")
            return None
        key = (self.op, compiled.hash)
        if key in self.rows:
            self.rows[key]["launches"] += 1
            return compiled
        row = dict(op=self.op, kernel=name, phase=self.phase, constexprs=constexprs, launches=1,
                   seconds=time.perf_counter() - began, warps=compiled.metadata.num_warps,
                   stages=compiled.metadata.num_stages, shared=getattr(compiled.metadata, "shared", None))
        try:
            row.update(ptxas_figures(self.backend, compiled))
        except Exception as error:
            self._fail(f"{self.op} {name}: ptxas -v on its PTX failed: {type(error).__name__}: "
                       f"{_first_lines(str(error))}")
            return compiled
        self.rows[key] = row
        limit = MAX_SHARED.get(self.target.arch)
        if row["shared"] is not None and limit is not None and row["shared"] > limit:
            self._fail(f"{self.op} {name}: {row['shared']} bytes of shared memory, over sm_{self.target.arch}'s "
                       f"{limit} per program")
        return compiled

    def _fail(self, line):
        self.failures.append(line)
        print(line, flush=True)


def _constexprs(jit, args, kwargs):
    """{name: value} of the launch's constexpr arguments."""
    parameters = inspect.signature(jit.fn).parameters
    bound = inspect.signature(jit.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in parameters})
    return {p.name: bound.arguments[p.name] for p in jit.params if p.is_constexpr and p.name in bound.arguments}


def _words(constexprs):
    return " ".join(f"{name}={value}" for name, value in constexprs.items())


def _one_line(text, chars=400):
    text = " ".join(text.split())
    return text if len(text) <= chars else text[:chars] + " ..."


def _first_lines(text, lines=12):
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n    ".join(kept[:lines] + ([f"... ({len(kept) - lines} more lines)"] if len(kept) > lines else []))


def ptxas_figures(backend, compiled):
    """Registers, spill stores and loads, stack frame (bytes per thread) of the kernel's entry function: triton's
    make_cubin, the ptxas command this triton runs, again on the kernel's PTX with TRITON_DUMP_PTXAS_LOG on."""
    from triton import knobs
    options = backend.parse_options(dict(compiled.metadata._asdict()))
    log = io.StringIO()
    previous = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            backend.make_cubin(compiled.asm["ptx"], dict(compiled.metadata._asdict()), options, backend.target.arch)
    finally:
        knobs.nvidia.dump_ptxas_log = previous
    return parse_ptxas_log(log.getvalue(), compiled.metadata.name)


def parse_ptxas_log(log, entry):
    """{"regs", "spill_stores", "spill_loads", "stack"} of `entry` from a `ptxas -v` log."""
    start = log.find(f"Compiling entry function '{entry}'")
    section = log[start:] if start >= 0 else log
    following = section.find("Compiling entry function", 1)
    section = section[:following] if following > 0 else section
    registers = re.search(r"Used (\d+) registers", section)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section)
    if not registers or not spills:
        raise ValueError(f"no register or spill figures for {entry} in ptxas's log:\n{log}")
    return dict(regs=int(registers[1]), stack=int(spills[1]), spill_stores=int(spills[2]),
                spill_loads=int(spills[3]))


HEADER = (f"{'op':<19}{'kernel':<24}{'phase':<6}{'warps':>5}{'stages':>7}{'regs':>6}{'spill st/ld B':>15}"
          f"{'stack B':>8}{'smem B':>8}{'launches':>9}{'compile s':>10}  constexprs")


def format_row(row):
    spills = f"{row['spill_stores']}/{row['spill_loads']}"
    flag = "  SPILLS" if row["spill_stores"] or row["spill_loads"] else ""
    shared = "?" if row["shared"] is None else row["shared"]
    return (f"{row['op']:<19}{row['kernel']:<24}{row['phase']:<6}{row['warps']:>5}{row['stages']:>7}{row['regs']:>6}"
            f"{spills:>15}{row['stack']:>8}{shared:>8}{row['launches']:>9}{row['seconds']:>10.2f}  "
            f"{_words(row['constexprs'])}{flag}")


# ---------------------------------------------------------------------------------------------------------------
# whether this triton can compile for the target here

def set_up(arch):
    """(target, backend) with the stand-in driver active, after compiling a probe kernel for the target; raises
    CannotCompileHere saying why not."""
    try:
        import triton

        from megatron_ds.core.fusions._triton import interpreter_ready, interpreting
        if interpreting() or interpreter_ready():
            raise CannotCompileHere("triton kernels are interpreted in this process (TRITON_INTERPRET=1 when triton "
                                    "was imported, or now): run the script in a process of its own")
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.driver import driver
    except ImportError as error:
        raise CannotCompileHere(f"triton is not importable ({error})")
    from triton.backends import backends
    if "nvidia" not in backends:
        raise CannotCompileHere(f"this triton {triton.__version__} has no NVIDIA backend (backends: "
                                f"{', '.join(backends) or 'none'})")
    target = GPUTarget("cuda", arch, 32)
    try:
        backend = make_backend(target)
        from triton.backends.nvidia.compiler import get_ptxas_version
        get_ptxas_version(arch)
    except Exception as error:
        raise CannotCompileHere(f"triton {triton.__version__}'s NVIDIA backend or its bundled ptxas does not run "
                                f"here ({type(error).__name__}: {_one_line(str(error))})")
    driver.set_active(StandInDriver(target))

    def _probe(X, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(X + offsets, tl.load(X + offsets, mask=offsets < n) * 2.0, mask=offsets < n)

    try:
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            probe = triton.jit(_probe).warmup(torch.float32, 1024, BLOCK=128, grid=(8,))
            if hasattr(probe, "result"):
                probe = probe.result()
        ptxas_figures(backend, probe)
    except Exception as error:
        raise CannotCompileHere(f"triton {triton.__version__} did not compile a probe kernel without a GPU "
                                f"({type(error).__name__}: {_one_line(str(error))})")
    return target, backend


def project_kernels():
    """'module.name' of every kernel (`_triton.kernel`) the fusion modules define."""
    from megatron_ds.core import fusions
    from megatron_ds.core.fusions._triton import kernel
    names = set()
    for name, module in list(sys.modules.items()):
        if name.startswith(fusions.__name__ + ".") and module is not None:
            for value in vars(module).values():
                if isinstance(value, kernel) and value.fn.__module__ == name:
                    names.add(f"{name}.{value.fn.__name__}")
    return names


def triton_ops():
    """The fused ops with a triton backend (bench/ops.py also times ops that have none, e.g. fp8_linear)."""
    from megatron_ds.core import fusions
    return {name for name, op in fusions.registered_ops().items() if "triton" in op.implementations}


def run_case(compiler, name, case):
    """The op's triton backend, forward then backward, on meta tensors."""
    from bench.ops import _outputs
    from megatron_ds.core import fusions
    implementation = fusions.registered_ops()[name].implementations["triton"]
    compiler.op, compiler.phase = name, "fwd"
    inputs = case.inputs()
    outputs = _outputs(case.call(implementation, inputs))
    compiler.phase = "bwd"
    torch.autograd.backward(outputs, [torch.ones_like(output) for output in outputs])


def main(argv=None):
    if "triton" not in sys.modules:  # before triton's first import: compile, never interpret (tests set it to 1)
        os.environ["TRITON_INTERPRET"] = "0"
    from bench.ops import SIZES, build_cases
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large", choices=list(SIZES), help="bench/ops.py's SIZES (default large)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 90 is sm_90a (H100, H200)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--ops", nargs="*", default=None, help="bench/ops.py's op names (default: every op)")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cases = build_cases(SIZES[args.size], dtype, torch.device("meta"))
    unknown = sorted(set(args.ops or ()) - set(cases))
    if unknown:
        parser.error(f"unknown ops {unknown}; bench/ops.py's are {sorted(cases)}")
    try:
        target, backend = set_up(args.arch)
    except CannotCompileHere as reason:
        print(f"cannot compile for sm_{args.arch} here: {reason}", flush=True)
        return CANNOT
    import triton
    from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version

    choices = gpu_choices(args.arch)
    unanswered = unanswered_device_choices(choices)
    if unanswered:
        print(f"the launch code makes device-dependent choices this script does not answer as a GPU: "
              f"{', '.join(unanswered)} (add them to gpu_choices in {Path(__file__).name})", flush=True)
        return 1
    release = re.search(r"release [\d.]+, V[\d.]+", get_ptxas_version(args.arch))
    print(f"triton {triton.__version__} (its {Path(get_ptxas(args.arch).path).name}: "
          f"{release[0] if release else 'version unknown'}), "
          f"torch {torch.__version__}: compiling for sm_{args.arch} ({target}) without a GPU; bench/ops.py size "
          f"{args.size} {SIZES[args.size]}, {args.dtype}", flush=True)
    print(HEADER, flush=True)
    compiler = Compiler(target, backend)
    with compiler.compile_only(), patched(choices):
        for name, case in cases.items():
            if (args.ops and name not in args.ops) or name not in triton_ops():
                continue
            try:
                run_case(compiler, name, case)
            except Exception as error:  # the op's own Python around its kernels
                compiler._fail(f"{name}: its triton launch code failed on meta tensors in {compiler.phase}: "
                               f"{type(error).__name__}: {_first_lines(str(error), 4)}")
            for row in compiler.rows.values():
                if row["op"] == name:
                    print(format_row(row), flush=True)
    if not args.ops:
        for missing in sorted(project_kernels() - compiler.launched):
            compiler._fail(f"{missing}: launched by no bench/ops.py case, so not compiled here")
    rows = list(compiler.rows.values())
    spilling = [f"{row['op']} {row['kernel']}" for row in rows if row["spill_stores"] or row["spill_loads"]]
    print(f"{len(rows)} kernels compiled for sm_{args.arch} in {time.perf_counter() - began:.1f} s; "
          f"max {max((row['regs'] for row in rows), default=0)} registers; "
          f"spilling: {', '.join(spilling) if spilling else 'none'}; "
          f"failures: {len(compiler.failures)}", flush=True)
    return 1 if compiler.failures else 0


if __name__ == "__main__":
    sys.exit(main())
