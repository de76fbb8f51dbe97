"""pretrain.py's start-up warning for --bf16 on a CPU without a bf16 matrix unit (megatron_ds/launch/cpu_features.py),
in real launches: printed once (rank 0) exactly when this host's cpuinfo and oneDNN say bf16 has no unit here, and
on any x86 host when oneDNN is kept to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2: what an AVX2-only EPYC's oneDNN runs on)."""
import re

import pytest

from megatron_ds.launch.cpu_features import describe, onednn_runs, this_cpu, warning_due
from tests.support.checkpoints import TINY
from tests.support.launch import assert_succeeded, launch, losses

FLAGS = TINY + ["--train-iters", "1", "--bf16"]
WARNING = re.compile(r"^megatron_ds: WARNING: --bf16 on CPU: (.*)$", re.MULTILINE)


def test_the_bf16_warning_appears_once_exactly_where_this_cpu_has_no_bf16_unit():
    result = launch(2, FLAGS)
    assert_succeeded(result, tail=3000)
    assert list(losses(result.stdout)) == [1], result.stdout[-3000:]
    facts = this_cpu()
    expected = 1 if warning_due(facts, "bf16", onednn_runs("bf16")) else 0
    assert len(WARNING.findall(result.stdout)) == expected, (describe(facts), result.stdout[-3000:])


@pytest.mark.skipif(this_cpu().architecture != "x86", reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 ISA")
def test_with_onednn_kept_to_avx2_the_warning_names_the_cpu_the_slowdown_and_the_advice():
    result = launch(2, FLAGS, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert_succeeded(result, tail=3000)
    warnings = WARNING.findall(result.stdout)
    assert len(warnings) == 1, result.stdout[-3000:]
    assert describe(this_cpu()) in warnings[0], warnings[0]
    slowdown = re.search(r"a 256\^3 bf16 matmul took ([0-9.]+)x the fp32 time here\. Train in fp32 on this CPU "
                         r"\(drop --bf16\)", warnings[0])
    assert slowdown and float(slowdown.group(1)) > 0, warnings[0]
