"""bench/ops.py's fp8_linear: each FP8 recipe's GEMMs (through fp8_linear) in turns with bf16 F.linear at the size's
fc1 shape, and each one's relative error against fp32 products, within the E4M3 bound (docs/fp8.md: 0.051)."""
import re

import torch

from bench import ops

E4M3_BOUND = 0.051


def test_each_recipe_is_timed_against_bf16_and_its_errors_printed(capsys):
    ops.main(["--ops", "fp8_linear", "--size", "tiny", "--rounds", "1", "--rotations-per-round", "1",
              "--device", "cpu", "--threads", "1"])
    out = capsys.readouterr().out
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        assert re.search(rf"^fp8_linear +{recipe} .* [0-9.]+x \(", out, re.MULTILINE), out
    errors = re.findall(r"^fp8_linear +(\w+) +relative error vs fp32: forward ([0-9.]+), dgrad ([0-9.]+), "
                        r"wgrad ([0-9.]+)$", out, re.MULTILINE)
    assert [name for name, *_ in errors] == ["bf16", "tensorwise", "rowwise", "blockwise"]
    for name, *values in errors[1:]:
        assert all(0 < float(value) < E4M3_BOUND for value in values), (name, values)


def test_gemm_errors_of_bf16_are_its_rounding():
    case = ops.build_cases(ops.SIZES["tiny"], torch.bfloat16, torch.device("cpu"))["fp8_linear"]
    assert all(error < 2 ** -7 for error in ops.gemm_errors(case, torch.nn.functional.linear))
