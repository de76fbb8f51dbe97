"""Fused ops: each available backend against the plain-PyTorch reference (what the model runs unfused).

Time of forward + backward (median of --repeats after --warmup calls) and memory, in one run:

    python bench/ops.py [--device cpu|cuda] [--dtype bf16|fp32] [--size small|large] [--ops swiglu ...]
                        [--backends reference compile triton apex] [--repeats N] [--warmup N]
                        [--clock wall|process] [--threads N]

On a shared CPU host: OMP_WAIT_POLICY=PASSIVE python bench/ops.py --clock process --threads 1

Memory: bytes of the tensors autograd saves for backward (unique storages, via saved_tensors_hooks), on
every device; on CUDA also the peak of max_memory_allocated over forward + backward above what was allocated
before. Ratios are fused / reference (< 1 is better). `first s` is the first call (compile time for compile).
Triton is timed on CUDA only (its CPU interpreter checks numerics, it is not a kernel).
"""
import argparse
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ds.core import fusions  # noqa: E402
from megatron_ds.core.transformer.rotary import RotaryEmbedding  # noqa: E402

SIZES = {  # sequence, micro batch, hidden, heads, ffn, vocab
    "tiny": dict(s=32, b=2, h=64, heads=4, ffn=256, vocab=256),         # the tests' models
    "h256": dict(s=512, b=4, h=256, heads=4, ffn=704, vocab=8192),
    "h512": dict(s=512, b=4, h=512, heads=8, ffn=1408, vocab=8192),     # the README's LLaMA-style row
    "small": dict(s=256, b=2, h=1024, heads=8, ffn=2816, vocab=32000),
    "large": dict(s=2048, b=4, h=4096, heads=32, ffn=11008, vocab=128256),
}


@dataclass
class Case:
    """inputs(): fresh leaf tensors; call(fn, inputs): the op's outputs (a tensor or a tuple)."""
    inputs: Callable[[], Dict[str, torch.Tensor]]
    call: Callable


def _leaf(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()


def build_cases(size, dtype, device):
    s, b, h, heads, ffn, vocab = (size[k] for k in ("s", "b", "h", "heads", "ffn", "vocab"))
    d = h // heads
    causal = fusions.causal_mask(s, s, device)[None, None]
    rotary = RotaryEmbedding(d).to(device)
    cos, sin = rotary(s, device)
    target = torch.randint(0, vocab, (s, b), device=device)
    seed = fusions.counter_hash.draw_seed(device)
    return {
        "scale_mask_softmax": Case(lambda: dict(scores=_leaf((b, heads, s, s), dtype, device)),
                                   lambda fn, t: fn(t["scores"], causal, 1 / math.sqrt(d), False)),
        "layer_norm": Case(lambda: dict(x=_leaf((s, b, h), dtype, device), w=_leaf((h,), torch.float32, device),
                                        bias=_leaf((h,), torch.float32, device)),
                           lambda fn, t: fn(t["x"], t["w"], t["bias"], 1e-5)),
        "rms_norm": Case(lambda: dict(x=_leaf((s, b, h), dtype, device), w=_leaf((h,), dtype, device)),
                         lambda fn, t: fn(t["x"], t["w"], None, 1e-5)),
        "rotary_pos_emb": Case(lambda: dict(q=_leaf((s, b, heads, d), dtype, device),
                                            k=_leaf((s, b, heads, d), dtype, device)),
                               lambda fn, t: fn(t["q"], t["k"], cos, sin)),
        "bias_gelu": Case(lambda: dict(x=_leaf((s, b, ffn), dtype, device), bias=_leaf((ffn,), dtype, device)),
                          lambda fn, t: fn(t["x"], t["bias"])),
        "bias_dropout_add": Case(lambda: dict(x=_leaf((s, b, h), dtype, device), bias=_leaf((h,), dtype, device),
                                              residual=_leaf((s, b, h), dtype, device)),
                                 lambda fn, t: fn(t["x"], t["bias"], t["residual"], 0.1, True)),
        "swiglu": Case(lambda: dict(x=_leaf((s, b, 2 * ffn), dtype, device)), lambda fn, t: fn(t["x"])),
        "cross_entropy": Case(lambda: dict(logits=_leaf((s, b, vocab), dtype, device, scale=3.0)),
                              lambda fn, t: fn(t["logits"], target)),
        "flash_attention": Case(lambda: {name: _leaf((b, heads, s, d), dtype, device) for name in "qkv"},
                                lambda fn, t: fn(t["q"], t["k"], t["v"], 0.1, seed)),
    }


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(case, fn):
    """Bytes autograd saves for backward (unique storages, inputs included: the op keeps them alive)."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    inputs = case.inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = _outputs(case.call(fn, inputs))
    del outputs
    return sum(storages.values())


def peak_bytes(case, fn, device):
    """CUDA: max_memory_allocated over forward + backward, above the inputs and gradients' buffers."""
    if device.type != "cuda":
        return None
    inputs = case.inputs()
    grads = [torch.randn_like(out) for out in _outputs(case.call(fn, inputs))]
    for tensor in inputs.values():
        tensor.grad = None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    outputs = _outputs(case.call(fn, inputs))
    torch.autograd.backward(outputs, grads)
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def timing(case, fn, device, warmup, repeats, clock=time.perf_counter):
    """(first call seconds, median forward ms, median forward + backward ms)."""
    inputs = case.inputs()
    began = time.perf_counter()
    outputs = _outputs(case.call(fn, inputs))
    grads = [torch.randn_like(out) for out in outputs]
    torch.autograd.backward(outputs, grads)
    _sync(device)
    first = time.perf_counter() - began
    forward, step = [], []
    for index in range(warmup + repeats):
        _sync(device)
        began = clock()
        outputs = _outputs(case.call(fn, inputs))
        _sync(device)
        middle = clock()
        torch.autograd.backward(outputs, grads)
        _sync(device)
        if index >= warmup:
            forward.append((middle - began) * 1e3)
            step.append((clock() - began) * 1e3)
        for tensor in inputs.values():
            tensor.grad = None
    return first, statistics.median(forward), statistics.median(step)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--size", default=None, choices=list(SIZES), help="default: large on CUDA, small on CPU")
    parser.add_argument("--ops", nargs="*", default=None)
    parser.add_argument("--backends", nargs="*", default=["reference", "compile", "triton", "apex"])
    parser.add_argument("--repeats", type=int, default=None, help="default: 10 on CPU, 50 on CUDA")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="process: this process's CPU seconds (steadier than wall time on a loaded CPU host; "
                             "set OMP_WAIT_POLICY=PASSIVE so that idle OpenMP threads do not spin)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    size_name = args.size or ("large" if device.type == "cuda" else "small")
    repeats = args.repeats or (50 if device.type == "cuda" else 10)
    cases = build_cases(SIZES[size_name], dtype, device)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"device {device}, {args.dtype}, size {size_name} {SIZES[size_name]}, threads {torch.get_num_threads()}, "
          f"median of {repeats} after {args.warmup} warm-up calls, {args.clock} clock")
    header = (f"{'op':<19}{'backend':<10}{'first s':>8}{'fwd ms':>9}{'fwd+bwd ms':>11}{'x ref':>7}"
              f"{'saved MiB':>10}{'x ref':>7}" + (f"{'peak MiB':>9}{'x ref':>7}" if device.type == "cuda" else ""))
    print(header)
    for name, case in cases.items():
        if args.ops and name not in args.ops:
            continue
        rows = {}
        for backend in ("reference", "compile", "triton", "apex"):
            if backend not in args.backends or backend not in fusions.registered_ops()[name].implementations:
                continue
            reason = fusions.unavailable_reason(name, backend, device)
            if backend == "triton" and device.type != "cuda":
                reason = reason or "interpreter only on CPU: numerics, not speed"
            if reason:
                print(f"{name:<19}{backend:<10}unavailable: {reason}")
                continue
            rows[backend] = fusions.registered_ops()[name].implementations[backend]
        results = {}
        for backend, fn in rows.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                first, forward, step = timing(case, fn, device, args.warmup, repeats, clock)
            results[backend] = (first, forward, step, saved_bytes(case, fn), peak_bytes(case, fn, device))
        ref = results.get("reference")
        for backend, (first, forward, step, saved, peak) in results.items():
            line = (f"{name:<19}{backend:<10}{first:8.2f}{forward:9.3f}{step:11.3f}"
                    f"{step / ref[2] if ref else float('nan'):7.2f}"
                    f"{saved / 2**20:10.2f}{saved / ref[3] if ref and ref[3] else float('nan'):7.2f}")
            if peak is not None:
                line += f"{peak / 2**20:9.1f}{peak / ref[4] if ref and ref[4] else float('nan'):7.2f}"
            print(line)


if __name__ == "__main__":
    main()
