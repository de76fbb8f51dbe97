"""Fused ops: each available backend against the plain-PyTorch reference (what the model runs unfused).

Time of forward + backward and memory, in one run:

    python bench/ops.py [--device cpu|cuda] [--dtype bf16|fp32] [--size small|large] [--ops swiglu ...]
                        [--backends reference compile triton apex] [--rounds N] [--rotations-per-round N]
                        [--clock wall|process] [--threads N]

On a shared CPU host: OMP_WAIT_POLICY=PASSIVE python bench/ops.py --clock process --threads 1

Method (bench/turns.py's alternate): an op's backends take turns call by call (forward + backward), so that a
slowdown of the host falls on every backend alike; each backend's time over the reference's is taken within a
rotation, a round's is the median of its rotations', and the median of the rounds prints with their range, or
"unstable" when they lie more than --max-spread apart. `first s` is the first call (compile time for compile),
outside the turns; `fwd ms` and `fwd+bwd ms` are medians over the timed calls.
Memory: bytes of the tensors autograd saves for backward (unique storages, via saved_tensors_hooks), on
every device; on CUDA also the peak of max_memory_allocated over forward + backward above what was allocated
before. Memory ratios are fused / reference (< 1 is better).
Triton is timed on CUDA only (its CPU interpreter checks numerics, it is not a kernel).
--backends sdpa adds torch's scaled_dot_product_attention (causal, the same dropout) to flash_attention's rows, and
each flash_attention backend's step prints over SDPA's too: the kernel a model gets without the op.
fp8_linear: fc1's GEMM at the size's shape (s b tokens x h -> ffn), forward and both backward GEMMs, through
core/tensor_parallel/fp8.fp8_linear in each recipe (E4M3) against bf16 F.linear (its "reference" row), in turns;
then each one's relative error (Frobenius) of the forward, input-gradient and weight-gradient products against
fp32 products of the same bf16 operands.
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

from bench.turns import (  # noqa: E402
    Ratio,
    add_arguments,
    alternate,
    host_line,
    keep_freed_memory,
    method_words,
    rounds_of,
    sequential,
    total_rotations,
)
from megatron_ds.core import fusions  # noqa: E402
from megatron_ds.core.tensor_parallel.fp8 import DYNAMIC_RECIPES as FP8_RECIPES  # noqa: E402  (delayed: tensorwise GEMMs)
from megatron_ds.core.tensor_parallel.fp8 import fp8_linear, fp8_support_problems  # noqa: E402
from megatron_ds.core.transformer.rotary import RotaryEmbedding  # noqa: E402

SIZES = {  # sequence, micro batch, hidden, heads, ffn, vocab
    "tiny": dict(s=32, b=2, h=64, heads=4, ffn=256, vocab=256),         # the tests' models
    "h256": dict(s=512, b=4, h=256, heads=4, ffn=704, vocab=8192),
    "h512": dict(s=512, b=4, h=512, heads=8, ffn=1408, vocab=8192),     # docs/performance.md's LLaMA-style row
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
        "fp8_linear": Case(lambda: dict(x=_leaf((s * b, h), torch.bfloat16, device),
                                        w=_leaf((ffn, h), torch.bfloat16, device, scale=h ** -0.5)),
                           lambda fn, t: fn(t["x"], t["w"])),
    }


def fp8_backends(device):
    """bf16 F.linear as the reference and fp8_linear in each recipe (E4M3) the device runs; the others named."""
    recipes = {}
    for recipe in FP8_RECIPES:
        problems = fp8_support_problems(device, recipe)
        if problems:
            print(f"{'fp8_linear':<19}{recipe} unavailable: {'; '.join(problems)}")
        else:
            recipes[recipe] = lambda x, w, recipe=recipe: fp8_linear(x, w, recipe, "e4m3")
    return {"reference": torch.nn.functional.linear, **recipes} if recipes else {}


def gemm_errors(case, fn):
    """Relative Frobenius errors of fn's forward, input-gradient and weight-gradient products against the fp32
    products of the same operands and output gradient."""
    inputs = case.inputs()
    output = case.call(fn, inputs)
    grad = torch.randn_like(output)
    output.backward(grad)
    x, w, dy = (tensor.detach().float() for tensor in (inputs["x"], inputs["w"], grad))
    exact = (x @ w.t(), dy @ w, dy.t() @ x)
    got = (output.detach(), inputs["x"].grad, inputs["w"].grad)
    return [float((g.float() - e).norm() / e.norm()) for g, e in zip(got, exact)]


def print_errors(name, case, rows):
    for backend, fn in rows.items():
        forward, dgrad, wgrad = gemm_errors(case, fn)
        label = "bf16" if backend == "reference" else backend
        print(f"{name:<19}{label:<10} relative error vs fp32: forward {forward:.4f}, dgrad {dgrad:.4f}, "
              f"wgrad {wgrad:.4f}")


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


WARM_UP_CALLS = 3


class Timed:
    """One backend of an op as a turn: its first call (timed apart), then forward + backward per step, the forward's
    time kept too."""

    def __init__(self, case, fn, device, clock):
        self.case, self.fn, self.device, self.clock = case, fn, device, clock
        self.inputs = case.inputs()
        began = time.perf_counter()
        outputs = _outputs(case.call(fn, self.inputs))
        self.grads = [torch.randn_like(out) for out in outputs]
        torch.autograd.backward(outputs, self.grads)
        _sync(device)
        self.first = time.perf_counter() - began
        self.forward = []

    def step(self):
        began = self.clock()
        outputs = _outputs(self.case.call(self.fn, self.inputs))
        _sync(self.device)
        self.forward.append(self.clock() - began)
        torch.autograd.backward(outputs, self.grads)
        for tensor in self.inputs.values():
            tensor.grad = None


def measure_op(case, backends, device, args, clock):
    """{backend: (Timed, [seconds per forward + backward])}, the backends in turns."""
    timed = {backend: Timed(case, fn, device, clock) for backend, fn in backends.items()}
    seconds = alternate({backend: entry.step for backend, entry in timed.items()},
                        total_rotations(args, WARM_UP_CALLS), lambda: _sync(device), sequential(args), clock)
    return {backend: (timed[backend], seconds[backend]) for backend in backends}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--size", default=None, choices=list(SIZES), help="default: large on CUDA, small on CPU")
    parser.add_argument("--ops", nargs="*", default=None)
    parser.add_argument("--backends", nargs="*", default=["reference", "compile", "triton", "apex", "sdpa"],
                        choices=BENCH_BACKENDS)
    add_arguments(parser, rotations_per_round=4)
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="process: this process's CPU seconds (steadier than wall time on a loaded CPU host; "
                             "set OMP_WAIT_POLICY=PASSIVE so that idle OpenMP threads do not spin)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args(argv)
    keep_freed_memory(args)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    size_name = args.size or ("large" if device.type == "cuda" else "small")
    cases = build_cases(SIZES[size_name], dtype, device)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"device {device}, {args.dtype}, size {size_name} {SIZES[size_name]}, threads {torch.get_num_threads()}, "
          f"an op's backends {method_words(args)}: {WARM_UP_CALLS} warm-up rotations, then "
          f"{rounds_of(args.rounds, args.rotations_per_round)}, {args.clock} clock")
    print(host_line(device))
    header = (f"{'op':<19}{'backend':<10}{'first s':>8}{'fwd ms':>9}{'fwd+bwd ms':>11}"
              f"{'saved MiB':>10}{'x ref':>7}" + (f"{'peak MiB':>9}{'x ref':>7}" if device.type == "cuda" else "")
              + "  fwd+bwd x ref")
    print(header)
    for name, case in cases.items():
        if args.ops and name not in args.ops:
            continue
        rows = fp8_backends(device) if name == "fp8_linear" else available_backends(name, args.backends, device)
        if not rows:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            measured = measure_op(case, rows, device, args, clock)
        print_op(name, case, rows, measured, device, args)
        if name == "fp8_linear":
            print_errors(name, case, rows)


def sdpa_flash_attention(query, key, value, dropout_p, seed):
    """flash_attention's signature on torch's SDPA (causal; SDPA draws its own dropout mask, seed unused)."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True)


BENCH_BACKENDS = ("reference", "compile", "triton", "apex", "sdpa")


def implementations(name):
    """{backend: callable} the bench can time for op `name`: the registry's, and SDPA for flash_attention."""
    found = dict(fusions.registered_ops()[name].implementations)
    if name == "flash_attention":
        found["sdpa"] = sdpa_flash_attention
    return found


def available_backends(name, requested, device):
    """{backend: implementation} of op `name` among `requested` that can be timed here; a line for each other."""
    rows = {}
    for backend in BENCH_BACKENDS:
        if backend not in requested or backend not in implementations(name):
            continue
        if backend == "sdpa":
            rows[backend] = sdpa_flash_attention
            continue
        reason = fusions.unavailable_reason(name, backend, device)
        if backend == "triton" and device.type != "cuda":
            reason = reason or "interpreter only on CPU: numerics, not speed"
        if reason:
            print(f"{name:<19}{backend:<10}unavailable: {reason}")
            continue
        rows[backend] = fusions.registered_ops()[name].implementations[backend]
    return rows


def print_op(name, case, rows, measured, device, args):
    """A line per backend: first call, median forward and step, memory, and the step's ratio to the reference's."""
    memory = {backend: (saved_bytes(case, fn), peak_bytes(case, fn, device)) for backend, fn in rows.items()}
    reference = measured.get("reference")
    for backend, (timed, steps) in measured.items():
        saved, peak = memory[backend]
        ref_saved, ref_peak = memory["reference"] if reference else (None, None)
        line = (f"{name:<19}{backend:<10}{timed.first:8.2f}{_median_ms(timed.forward):9.3f}{_median_ms(steps):11.3f}"
                f"{saved / 2**20:10.2f}{saved / ref_saved if ref_saved else float('nan'):7.2f}")
        if peak is not None:
            line += f"{peak / 2**20:9.1f}{peak / ref_peak if ref_peak else float('nan'):7.2f}"
        if reference and backend != "reference":
            line += "  " + Ratio.of(steps, reference[1], args.rounds, WARM_UP_CALLS).text(args.max_spread)
        if "sdpa" in measured and backend not in ("sdpa", "reference"):
            sdpa = Ratio.of(steps, measured["sdpa"][1], args.rounds, WARM_UP_CALLS)
            line += f"; x sdpa {sdpa.text(args.max_spread)}"
        print(line)


def _median_ms(seconds):
    return statistics.median(seconds[WARM_UP_CALLS:]) * 1e3


if __name__ == "__main__":
    main()
