"""Every GPT/LLaMA launch script of Megatron-DeepSpeed, at its real model size, through tools/plan.py (pretrain.py's
own validation, for a cluster that is not this machine): it validates and gets a plan, or it is refused with a
message that names the feature or the contradiction, never as an unknown flag."""
import re
from pathlib import Path

import pytest

from megatron_ds.arguments import ArgumentsError, parse_flags, raise_if_invalid
from megatron_ds.planning import plan_cli as cli
from tests.support.megatron_deepspeed_scripts import SCRIPTS, command_line, make_tokenizer_files, world_size

MOS = "--mos: Mixture-of-Students (distillation into an MoE student) is not built"
COMPRESSION = 'enables "compression_training": DeepSpeed Compression'

# scripts refused on purpose: what each message must say
REFUSED = {
    "examples_deepspeed/MoE/ds_pretrain_gpt_1.3B_PR-MoE64or128_MoS.sh": MOS,
    # its 32-expert layers cannot be split over its --moe-expert-parallel-size 64 (DeepSpeed's MoE asserts the same)
    "examples_deepspeed/MoE/ds_pretrain_gpt_350M_PR-MoE32or64.sh": "--num-experts 32 is not divisible by "
                                                                   "--moe-expert-parallel-size 64",
    "examples_deepspeed/compression/125M-Int8-test-64gpu-distilled-group48.sh": COMPRESSION,
    "examples_deepspeed/compression/125M-L10-Int8-test-64gpu-distilled-group48.sh": COMPRESSION,
    "examples_deepspeed/compression/125M-L12-Int8-test-64gpu-distilled-group48.sh": COMPRESSION,
    # the script leaves ZERO_STAGE unsubstituted in its JSON (it does not run on Megatron-DeepSpeed either)
    "examples_deepspeed/MoE/ds_pretrain_gpt_350M_PR-MoE32or64_MoS.sh": '"stage": "ZERO_STAGE"',
    "examples_deepspeed/offload_pp/ds_pretrain_gpt_350M.sh": '--fp16 conflicts with "bf16": {"enabled": true}',
    # its JSON disagrees with its flags (train_batch_size 512 vs --global-batch-size 4096, its own optimizer)
    "examples_deepspeed/curriculum_learning/ds_pretrain_gpt2.sh": '--global-batch-size 4096 conflicts with',
    # --global-batch-size 1024 against its JSON's train_batch_size 64
    "examples_deepspeed/run_deepspeed_example.sh": "--global-batch-size 1024 conflicts with",
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return make_tokenizer_files(tmp_path_factory.mktemp("tokenizers"))


def plan(name, tokenizer_files, folder):
    argv = command_line(name, tokenizer_files, folder)
    args, problems = parse_flags(cli.build_plan_parser(), argv + ["--world-size", str(world_size(name, argv))])
    raise_if_invalid(problems)
    return cli.run(args)


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - set(REFUSED)))
def test_script_validates_and_is_planned(name, tokenizer_files, tmp_path):
    result, status = plan(name, tokenizer_files, tmp_path)
    assert status == 0, result["plan"]["errors"]
    assert result["plan"]["parameters"]["total"] > 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_script_is_refused_by_name(name, tokenizer_files, tmp_path):
    with pytest.raises(ArgumentsError) as raised:
        plan(name, tokenizer_files, tmp_path)
    assert any(REFUSED[name] in problem for problem in raised.value.problems), raised.value
    assert not any("unrecognized arguments" in problem for problem in raised.value.problems), raised.value


def test_most_scripts_validate():
    """The count the README reports."""
    assert len(SCRIPTS) == 61 and len(set(SCRIPTS) - set(REFUSED)) == 52


def test_flags_page_lists_every_flag_of_the_scripts():
    """docs/megatron_deepspeed_flags.md says what each flag the scripts pass does here."""
    page = (Path(__file__).resolve().parents[4] / "docs" / "megatron_deepspeed_flags.md").read_text()
    listed = set(re.findall(r"`(--[A-Za-z0-9_-]+)`", page))
    used = {flag for script in SCRIPTS.values() for flag, _ in script["flags"]}
    assert used - listed == set()
