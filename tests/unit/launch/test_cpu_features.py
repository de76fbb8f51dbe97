"""The CPU's facts from /proc/cpuinfo texts of other CPUs (an AVX2-only AMD EPYC, a Sapphire Rapids with AMX, Arm
Graviton2 and 3) and of this host, the 16-bit warning decided from them, and the measured matmul ratio."""
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ds.launch import cpu_features
from megatron_ds.launch.cpu_features import (
    CpuFacts,
    describe,
    has_native_unit,
    parse_cpuinfo,
    sixteen_bit_warning,
    sixteen_bit_warning_here,
    warning_due,
)

# AWS m6a (Zen 3 "Milan"): AVX2 and F16C (fp16 conversions only), no AVX-512 at all
EPYC_MILAN = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 1
model name	: AMD EPYC 7R13 Processor
stepping	: 1
cpu MHz		: 2650.000
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid aperfmperf \
tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand \
hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch topoext perfctr_core invpcid_single ssbd \
ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec \
xgetbv1 clzero xsaveerptr rdpru wbnoinvd arat npt nrip_save vaes vpclmulqdq rdpid
bugs		: sysret_ss_attrs spectre_v1 spectre_v2 spec_store_bypass

processor	: 1
vendor_id	: AuthenticAMD
model name	: AMD EPYC 7R13 Processor
flags		: fpu avx2
"""
# AWS m7i (Sapphire Rapids): AVX512-BF16, AVX512-FP16 and AMX
SAPPHIRE_RAPIDS = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht \
syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni \
pclmulqdq monitor ssse3 fma cx16 pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c \
rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 \
avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw \
avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd ida arat avx512vbmi umip pku ospke waitpkg \
avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq rdpid cldemote movdiri movdir64b \
md_clear serialize amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities
"""
# AWS c7g (Graviton3, Neoverse V1): BF16 and FP16 arithmetic
GRAVITON3 = """processor	: 0
BogoMIPS	: 2100.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x1
CPU part	: 0xd40
CPU revision	: 1
"""
# AWS c6g (Graviton2, Neoverse N1): FP16 arithmetic, no BF16
GRAVITON2 = GRAVITON3.replace(
    "asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg "
    "dcpodp svei8mm svebf16 i8mm bf16 dgh rng", "asimdrdm lrcpc dcpop asimddp ssbs").replace("0xd40", "0xd0c")
POWER9 = "processor	: 0\ncpu		: POWER9 (architected), altivec supported\nclock		: 2200.000000MHz\n"


def _flags(text):
    return set(re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE).group(1).split())


def test_each_cpu_s_model_and_extensions_are_read_from_its_first_entry():
    assert parse_cpuinfo(EPYC_MILAN) == CpuFacts("x86", "AMD EPYC 7R13 Processor", frozenset({"avx2"}))
    assert parse_cpuinfo(SAPPHIRE_RAPIDS) == CpuFacts("x86", "Intel(R) Xeon(R) Platinum 8488C", frozenset(
        {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16"}))
    assert parse_cpuinfo(GRAVITON3) == CpuFacts("aarch64", "Arm Neoverse V1", frozenset(
        {"asimd", "fphp", "asimdhp", "bf16", "i8mm", "sve", "svebf16"}))
    assert parse_cpuinfo(GRAVITON2) == CpuFacts("aarch64", "Arm Neoverse N1", frozenset({"asimd", "fphp", "asimdhp"}))
    for text in (POWER9, "", None):
        assert not parse_cpuinfo(text).known and parse_cpuinfo(text).extensions == frozenset()
    assert parse_cpuinfo(POWER9).model == "POWER9 (architected), altivec supported"


def test_a_16_bit_format_is_native_only_with_its_own_unit():
    """f16c (fp16 conversions) is no fp16 unit; Graviton2 has fp16 arithmetic but no bf16; unknown: no claim."""
    expected = {EPYC_MILAN: (False, False), SAPPHIRE_RAPIDS: (True, True), GRAVITON3: (True, True),
                GRAVITON2: (False, True), POWER9: (None, None)}
    for text, (bf16, fp16) in expected.items():
        facts = parse_cpuinfo(text)
        assert (has_native_unit(facts, "bf16"), has_native_unit(facts, "fp16")) == (bf16, fp16), facts


def test_describe_names_the_model_and_the_extensions_present_and_absent():
    assert describe(parse_cpuinfo(EPYC_MILAN)) == (
        "AMD EPYC 7R13 Processor (x86: avx2; without avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16 amx_fp16)")
    assert describe(parse_cpuinfo(GRAVITON3)) == (
        "Arm Neoverse V1 (aarch64: asimd fphp asimdhp bf16 i8mm sve svebf16; without sve2 sme)")
    assert "extensions unknown" in describe(parse_cpuinfo(POWER9))


def test_the_warning_names_the_flag_the_cpu_the_measured_ratio_and_the_advice():
    text = sixteen_bit_warning(parse_cpuinfo(EPYC_MILAN), "bf16", 85.3)
    assert text.startswith("--bf16 on CPU: this CPU has no bf16 matrix unit (avx512_bf16 or amx_bf16): AMD EPYC 7R13 "
                           "Processor (x86: avx2; without "), text
    assert "a 256^3 bf16 matmul took 85x the fp32 time here. Train in fp32 on this CPU (drop --bf16)" in text, text
    assert "took 2.5x the fp32 time" in sixteen_bit_warning(parse_cpuinfo(GRAVITON2), "bf16", 2.46)
    fp16 = sixteen_bit_warning(parse_cpuinfo(EPYC_MILAN), "fp16", 30.0)
    assert "--fp16 on CPU: this CPU has no fp16 matrix unit (avx512_fp16 or amx_fp16)" in fp16 and "drop --fp16" in fp16
    # a unit that this torch's oneDNN is kept off (ONEDNN_MAX_CPU_ISA=AVX2) is as good as none
    kept_off = sixteen_bit_warning(parse_cpuinfo(SAPPHIRE_RAPIDS), "bf16", 40.0, onednn=False)
    assert "has bf16 instructions but torch's oneDNN does not use them" in kept_off and "40x" in kept_off


@pytest.mark.parametrize("text, fmt", [(SAPPHIRE_RAPIDS, "bf16"), (SAPPHIRE_RAPIDS, "fp16"), (GRAVITON3, "bf16"),
                                       (GRAVITON2, "fp16"), (POWER9, "bf16"), (EPYC_MILAN, None)])
def test_no_warning_where_the_format_has_its_unit_or_the_cpu_is_unknown_or_the_run_is_fp32(text, fmt):
    assert not warning_due(parse_cpuinfo(text), fmt) and sixteen_bit_warning(parse_cpuinfo(text), fmt, 50.0) is None


def test_the_matmul_is_measured_only_when_the_warning_is_due(monkeypatch):
    monkeypatch.setattr(cpu_features, "onednn_runs", lambda fmt: True)
    measured = []

    def measure(fmt):
        measured.append(fmt)
        return 85.0

    warning = sixteen_bit_warning_here(torch.bfloat16, parse_cpuinfo(EPYC_MILAN), measure)
    assert "85x" in warning and measured == ["bf16"]
    for dtype, text in ((torch.bfloat16, SAPPHIRE_RAPIDS), (torch.float16, GRAVITON3), (torch.bfloat16, POWER9),
                        (torch.float32, EPYC_MILAN)):
        assert sixteen_bit_warning_here(dtype, parse_cpuinfo(text), measure) is None
    assert measured == ["bf16"]


def test_this_host_s_facts_agree_with_its_own_cpuinfo_and_decide_its_warning():
    """Whatever this host is: its extensions are those its cpuinfo lists; the bf16 warning (and its measurement)
    happens exactly when the parsed facts (and oneDNN) say bf16 has no unit here."""
    facts = cpu_features.this_cpu()
    print(f"this host: {describe(facts)}; oneDNN bf16 {cpu_features.onednn_runs('bf16')}, "
          f"fp16 {cpu_features.onednn_runs('fp16')}")
    text = cpu_features.read_cpuinfo()
    if text is None or not facts.known:
        assert sixteen_bit_warning_here(torch.bfloat16, facts, measure=pytest.fail) is None
        return
    assert facts.extensions == _flags(text) & set(facts.relevant)
    measured = []
    warning = sixteen_bit_warning_here(torch.bfloat16, facts, lambda fmt: measured.append(fmt) or 9.0)
    due = warning_due(facts, "bf16", cpu_features.onednn_runs("bf16"))
    assert (warning is not None) == due == (measured == ["bf16"]), (facts, warning)
    if facts.architecture == "x86" and not {"avx512_bf16", "amx_bf16"} & _flags(text):
        assert due  # an x86 CPU without either is warned about, whatever oneDNN says


def test_the_measured_ratio_is_positive_and_quick():
    started = time.perf_counter()
    ratio = cpu_features.measure_slowdown("bf16")
    assert ratio > 0 and time.perf_counter() - started < 1.0  # ~0.25 s budget plus the warm-up


def test_the_benches_host_line_names_this_cpu_and_its_cores():
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from bench.turns import host_line
    line = host_line("cpu")
    assert line.startswith(f"host: CPU {describe(cpu_features.this_cpu())}, ") and re.search(r", \d+ cores?$", line)
