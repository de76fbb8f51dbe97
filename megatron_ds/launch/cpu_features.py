"""This host's CPU: its model and the vector / matrix extensions that decide how fast a 16-bit (bf16, fp16) matmul
runs on it, read from /proc/cpuinfo (Linux on x86 and aarch64; elsewhere: unknown, and no claim is made), and a
measured fp32 / 16-bit matmul time ratio. The one place that reads the CPU's flags.

torch runs a CPU's bf16 / fp16 matmuls through oneDNN on the CPU's 16-bit instructions (x86: AVX512-BF16 or AMX for
bf16, AVX512-FP16 or AMX-FP16 for fp16; aarch64: BF16, and FP16 arithmetic). Without them the matmul falls back to a
path that converts element by element: on an AVX2-only AMD EPYC (Zen 2/3), a 512^3 bf16 matmul ran at 1.3 GFLOP/s
against fp32's 108 (torch 2.13, 2 threads), 85x slower. pretrain.py warns at start-up when its --bf16 / --fp16 has no
such unit on this CPU (sixteen_bit_warning_here); the benches name the CPU in their header (bench/turns.py).

Parsing is pure (parse_cpuinfo: a cpuinfo text -> CpuFacts), so tests feed other CPUs' texts; torch is imported only
by what measures or asks oneDNN.
"""
import dataclasses
import statistics
import time
from typing import Callable, FrozenSet, Optional

CPUINFO = "/proc/cpuinfo"
# the extensions reported, in this order: x86's `flags` line, aarch64's `Features` line
X86_EXTENSIONS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16", "amx_fp16")
AARCH64_EXTENSIONS = ("asimd", "fphp", "asimdhp", "bf16", "i8mm", "sve", "sve2", "svebf16", "sme")
# architecture: {16-bit format: the extensions of which any one gives it a native unit}. x86: AVX512-BF16 (Cooper
# Lake, Sapphire Rapids, AMD Zen 4 on) or AMX-BF16 (Sapphire Rapids on); AVX512-FP16 (Sapphire Rapids on) or
# AMX-FP16 (Granite Rapids). aarch64: FEAT_BF16 (BFDOT / BFMMLA: Neoverse V1 / Graviton3 on); FEAT_FP16 (asimdhp:
# Neoverse N1 / Graviton2 on)
NATIVE = {"x86": {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")},
          "aarch64": {"bf16": ("bf16",), "fp16": ("asimdhp",)}}
FORMATS = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}  # str(dtype): the flag's format
# aarch64 /proc/cpuinfo names no model: (CPU implementer, CPU part) -> name, for the common server cores
ARM_PARTS = {(0x41, 0xd0c): "Arm Neoverse N1", (0x41, 0xd40): "Arm Neoverse V1", (0x41, 0xd49): "Arm Neoverse N2",
             (0x41, 0xd4f): "Arm Neoverse V2", (0x41, 0xd8e): "Arm Neoverse N3", (0x41, 0xd84): "Arm Neoverse V3",
             (0x41, 0xd08): "Arm Cortex-A72", (0x41, 0xd0b): "Arm Cortex-A76", (0x48, 0xd01): "HiSilicon Kunpeng 920",
             (0xc0, 0xac3): "AmpereOne"}
MATMUL_SIZE = 256


@dataclasses.dataclass(frozen=True)
class CpuFacts:
    """architecture: "x86", "aarch64", or None where unknown (no /proc/cpuinfo, another architecture): then no
    claim is made about its extensions. extensions: those of X86_EXTENSIONS / AARCH64_EXTENSIONS it has."""
    architecture: Optional[str] = None
    model: Optional[str] = None
    extensions: FrozenSet[str] = frozenset()

    @property
    def known(self):
        return self.architecture is not None

    @property
    def relevant(self):
        """The extensions looked for on this architecture, in their order."""
        return {"x86": X86_EXTENSIONS, "aarch64": AARCH64_EXTENSIONS}.get(self.architecture, ())


def parse_cpuinfo(text: Optional[str]) -> CpuFacts:
    """The facts of a /proc/cpuinfo text (its first processor's entry: every core of a host has the same). x86 lists
    its extensions on `flags`, aarch64 on `Features` (with `CPU architecture: 8`); anything else is unknown."""
    if not text:
        return CpuFacts()
    fields = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        key = key.strip()
        if colon and key and key not in fields:
            fields[key] = value.strip()
    if "flags" in fields and ("vendor_id" in fields or "model name" in fields):
        present = set(fields["flags"].split())
        model = fields.get("model name") or fields.get("vendor_id")
        return CpuFacts("x86", model, frozenset(name for name in X86_EXTENSIONS if name in present))
    if "Features" in fields and fields.get("CPU architecture", "").strip() in ("8", "AArch64"):
        present = set(fields["Features"].split())
        return CpuFacts("aarch64", fields.get("model name") or _arm_model(fields),
                        frozenset(name for name in AARCH64_EXTENSIONS if name in present))
    return CpuFacts(model=fields.get("model name") or fields.get("cpu"))


def _arm_model(fields):
    try:
        implementer, part = int(fields["CPU implementer"], 16), int(fields["CPU part"], 16)
    except (KeyError, ValueError):
        return None
    return ARM_PARTS.get((implementer, part), f"Arm CPU (implementer {implementer:#x}, part {part:#x})")


def read_cpuinfo(path=CPUINFO) -> Optional[str]:
    """The text of /proc/cpuinfo, or None where there is none (not Linux)."""
    try:
        with open(path) as cpuinfo:
            return cpuinfo.read()
    except OSError:
        return None


def this_cpu() -> CpuFacts:
    return parse_cpuinfo(read_cpuinfo())


def format_of(dtype) -> Optional[str]:
    """"bf16" / "fp16" for torch.bfloat16 / torch.float16 (or those names), None for any other dtype."""
    return dtype if dtype in ("bf16", "fp16") else FORMATS.get(str(dtype))


def has_native_unit(facts: CpuFacts, fmt: str) -> Optional[bool]:
    """Whether the CPU has instructions for 16-bit format `fmt` ("bf16" / "fp16") that oneDNN's matmuls use; None
    where the CPU is unknown."""
    if not facts.known:
        return None
    return any(name in facts.extensions for name in NATIVE[facts.architecture][fmt])


def describe(facts: CpuFacts) -> str:
    """'AMD EPYC 7R13 Processor (x86: avx2; without avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16 amx_fp16)'."""
    model = facts.model or "unknown model"
    if not facts.known:
        return f"{model} (extensions unknown: no x86 or aarch64 /proc/cpuinfo)"
    present = [name for name in facts.relevant if name in facts.extensions]
    absent = [name for name in facts.relevant if name not in facts.extensions]
    return (f"{model} ({facts.architecture}: {' '.join(present) or 'none of ' + ' '.join(facts.relevant)}"
            + (f"; without {' '.join(absent)}" if present and absent else "") + ")")


def onednn_runs(fmt: str) -> Optional[bool]:
    """Whether this torch's oneDNN runs `fmt` matmuls on this CPU (it can be kept off the CPU's 16-bit instructions,
    e.g. by ONEDNN_MAX_CPU_ISA=AVX2); None where torch does not say."""
    import torch
    check = getattr(torch.ops.mkldnn, f"_is_mkldnn_{fmt}_supported", None)
    try:
        return bool(check()) if check is not None else None
    except RuntimeError:
        return None


def warning_due(facts: CpuFacts, fmt: Optional[str], onednn: Optional[bool] = None) -> bool:
    """A run in `fmt` deserves the warning: the CPU is known and has no native unit for it, or has one that oneDNN
    does not use (onednn False)."""
    if fmt is None or not facts.known:
        return False
    return not has_native_unit(facts, fmt) or onednn is False


def sixteen_bit_warning(facts: CpuFacts, fmt: Optional[str], ratio: Optional[float], onednn: Optional[bool] = None,
                        size=MATMUL_SIZE) -> Optional[str]:
    """The start-up warning of a run in 16-bit format `fmt` ("bf16" / "fp16", None for fp32) on the CPU `facts`,
    with `ratio` the measured 16-bit / fp32 time of a size^3 matmul (None: not measured); None when none is due."""
    if not warning_due(facts, fmt, onednn):
        return None
    units = " or ".join(NATIVE[facts.architecture][fmt])
    if has_native_unit(facts, fmt):
        why = (f"this CPU has {fmt} instructions but torch's oneDNN does not use them (ONEDNN_MAX_CPU_ISA set, or "
               f"a build without them): {describe(facts)}")
    else:
        why = f"this CPU has no {fmt} matrix unit ({units}): {describe(facts)}"
    measured = ""
    if ratio is not None:
        measured = f"; a {size}^3 {fmt} matmul took {ratio:.{0 if ratio >= 10 else 1}f}x the fp32 time here"
    return f"--{fmt} on CPU: {why}{measured}. Train in fp32 on this CPU (drop --{fmt}), or use a CPU with {units}."


def measure_slowdown(fmt: str, size=MATMUL_SIZE, repeats=5, budget_s=0.25) -> float:
    """The median time of a size^3 matmul in `fmt` over fp32's on this CPU (its threads as they are set): one
    warm-up of each, then up to `repeats` of each in turns, fewer once budget_s is spent (about 0.1 s on the
    AVX2-only EPYC above with two threads; milliseconds where the format has a unit)."""
    import torch
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    generator = torch.Generator().manual_seed(0)  # not the global one: the run's random numbers stay as they were
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    pairs = {torch.float32: (a, b), half: (a.to(half), b.to(half))}
    times = {dtype: [] for dtype in pairs}
    for x, y in pairs.values():
        torch.matmul(x, y)
    start = time.perf_counter()
    for _ in range(repeats):
        for dtype, (x, y) in pairs.items():
            began = time.perf_counter()
            torch.matmul(x, y)
            times[dtype].append(time.perf_counter() - began)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times[half]) / max(statistics.median(times[torch.float32]), 1e-9)


def sixteen_bit_warning_here(dtype, facts: Optional[CpuFacts] = None,
                             measure: Callable[[str], float] = measure_slowdown) -> Optional[str]:
    """pretrain.py's start-up warning for a run in `dtype` (its params dtype) on this CPU (call it where the device
    is the CPU), or None. The matmul is measured only when the warning is due."""
    fmt = format_of(dtype)
    if fmt is None:
        return None
    facts = this_cpu() if facts is None else facts
    if not facts.known:
        return None
    onednn = onednn_runs(fmt)
    if not warning_due(facts, fmt, onednn):
        return None
    return sixteen_bit_warning(facts, fmt, measure(fmt), onednn)


def host_description(cores: Optional[int] = None) -> str:
    """This CPU in one phrase, for a log or a bench's header: 'AMD EPYC (x86: avx2 ...; without ...), 2 cores'."""
    text = describe(this_cpu())
    return text + (f", {cores} core{'s' if cores != 1 else ''}" if cores is not None else "")

