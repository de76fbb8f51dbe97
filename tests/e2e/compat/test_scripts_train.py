"""Megatron-DeepSpeed launch scripts' flag sets train: every flag as the script passes it, only the model and the
run made tiny for a CPU (tests/support/megatron_deepspeed_scripts.py says what is replaced). One script's ranks are
started by the deepspeed launcher, as its users start them (the launcher adds --local_rank=R to the flags); the
others' are forked by tests/support/zygote.py, the same ranks without the launcher's and the imports' ~15 s per
launch on this 2-core host (tests/e2e/test_launchers.py checks each launcher against the others)."""
import re

import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.megatron_deepspeed_scripts import (
    SCRIPTS,
    distils,
    is_moe,
    make_datasets,
    make_tokenizer_files,
    tiny_command_line,
    tiny_teacher_command_line,
)

ITERATIONS = 3
# One script per feature a launch script exercises (the others' flag sets are parsed and checked by
# test_scripts_validate.py; each training launch costs 3-10 s of the suite)
TRAINED = [
    "examples/pretrain_gpt.sh",                                            # iterations, warmup fraction, fp16
    "examples/pretrain_gpt3_175B.sh",                                      # samples, old recompute name, TP x PP
    "examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh",                # Mixture of Experts (4 experts, EP 2)
    # its JSON's blocks off
    "examples_deepspeed/data_efficiency/gpt/pretrain/ds_pretrain_gpt_1.3B_dense_base_script.sh",
    "examples_deepspeed/deepspeed4science/megatron_long_seq_support/pretrain_gpt_1.3B_seq_parallel.sh",
    "examples_deepspeed/sequence_parallel/ds_pretrain_gpt_6.7B_fpdt_32k.sh",  # FPDT (Ulysses 2, 2 chunks), ZeRO-3
    "examples_deepspeed/pretrain_llama2_distributed.sh",                   # LLaMA: rmsnorm, GPTSentencePiece, GQA
    "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B_rope_slw.sh",          # partial rotary, curriculum, tokens
    "examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh",  # LLaMA, bf16
    "examples_deepspeed/zero_bubble_pp/zbh1_pretrain_gpt_1.3b.sh",         # ZB-H1 (exact semantics), ZeRO 0
    # knowledge distillation from a tiny teacher trained here: the three dense scripts (TP 2; curriculum; plain)
    "examples_deepspeed/compression/ds_pretrain_gpt_1.3B_dense_cl_kd.sh",
    "examples_deepspeed/compression/ds_pretrain_gpt_125M_dense_cl_kd.sh",
    "examples_deepspeed/compression/ds_pretrain_gpt_125M_dense_kd.sh",
]
THROUGH_THE_DEEPSPEED_LAUNCHER = "examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh"   # as the script launches


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compat")
    files = make_tokenizer_files(folder / "tokenizers")
    return files, make_datasets(folder, files)


@pytest.fixture(scope="module")
def teacher(inputs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    result = launch(1, tiny_teacher_command_line(*inputs, folder))
    assert_succeeded(result, tail=4000)
    return folder / "teacher"


@pytest.mark.parametrize("name", TRAINED)
def test_script_trains(name, inputs, tmp_path, request):
    files, datasets = inputs
    teacher = request.getfixturevalue("teacher") if distils(name) else None
    argv, ranks = tiny_command_line(name, files, datasets, tmp_path, ITERATIONS, teacher)
    launcher = "deepspeed" if name == THROUGH_THE_DEEPSPEED_LAUNCHER else "torchrun"
    result = launch(ranks, argv, launcher=launcher, timeout=240)
    assert_succeeded(result, tail=4000)
    assert sorted(losses(result.stdout)) == list(range(1, ITERATIONS + 1)), result.stdout[-4000:]
    assert "unrecognized" not in result.stdout
    if is_moe(name):
        assert re.search(r"lm loss: \S+ \| moe loss: \S+ \|", result.stdout), result.stdout[-4000:]
    if distils(name):
        assert len(re.findall(r"lm loss: \S+ \| kd loss: \S+ \|", result.stdout)) == ITERATIONS, result.stdout[-4000:]
    if (SCRIPTS[name]["ds_config"] or {}).get("curriculum_learning", {}).get("enabled"):
        # min 8 to max 32 over the 3 iterations (tests/support/megatron_deepspeed_scripts.py): 8 + 24 i / 3
        assert re.findall(r"curriculum seqlen: (\d+) \|", result.stdout) == ["16", "24", "32"], result.stdout[-4000:]
