"""--cpu-optimizer and the DeepSpeed JSON's zero_optimization.offload_optimizer: AdamW becomes DeepSpeed's CPU Adam
(DeepSpeedCPUAdam, AdamW mode). The combinations that cannot run are refused before any process group; CPU Adam as
built steps like torch's AdamW with the same groups. A launch with the offload: tests/e2e/test_cpu_optimizer.py."""
import json
import re
import types

import pytest
import torch

from megatron_ds.arguments import ArgumentsError, build_parser, parse_flags, resolve
from megatron_ds.training.optimizer import build_optimizer, optimizer_description, parameter_groups
from tests.support.flags import OFFLOAD, TINY_MODEL, parse_with_deepspeed_json


def _problems(tmp_path, argv, ds=None, world=1):
    with pytest.raises(ArgumentsError) as raised:
        parse_with_deepspeed_json(tmp_path, TINY_MODEL + argv, ds=ds, world=world)
    return raised.value.problems


def _offload(device="cpu", **zero):
    return {"zero_optimization": {**zero, "offload_optimizer": {"device": device}}}


# --- the arguments ---------------------------------------------------------------------------------------

def test_cpu_optimizer_on_this_cpu_host_parses_and_selects_cpu_adam(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on a GPU host --cpu-optimizer needs the optimizer offload")
    args = parse_with_deepspeed_json(tmp_path, TINY_MODEL + ["--cpu-optimizer"])
    assert (args.cpu_adam, args.offload_optimizer_device) == (True, "none")
    assert optimizer_description(args, "cpu") == "AdamW:deepspeed-cpu-adam"


def test_json_offload_at_pp1_zero1_parses_and_implies_cpu_adam(tmp_path):
    args = parse_with_deepspeed_json(tmp_path, TINY_MODEL, ds=OFFLOAD, world=2)
    assert (args.cpu_adam, args.offload_optimizer_device, args.zero_stage) == (True, "cpu", 1)
    assert args.effective_deepspeed_config["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    assert optimizer_description(args, "cpu") == "AdamW:deepspeed-cpu-adam"
    # DeepSpeed's deprecated spelling of the same offload
    args = parse_with_deepspeed_json(tmp_path, TINY_MODEL, ds={"zero_optimization": {"cpu_offload": True}})
    assert (args.cpu_adam, args.offload_optimizer_device) == (True, "cpu")


def test_without_either_adamw_is_torch_s(tmp_path):
    args = parse_with_deepspeed_json(tmp_path, TINY_MODEL, ds=_offload("none"))
    assert (args.cpu_adam, args.offload_optimizer_device) == (False, "none")
    assert optimizer_description(args, "cpu") == "AdamW:torch-fused"


def test_offload_with_pipeline_parallelism_is_refused(tmp_path):
    problems = _problems(tmp_path, ["--pipeline-model-parallel-size", "2"], ds=_offload(), world=2)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f'"zero_optimization.offload_optimizer.device": "cpu" in {tmp_path / "ds.json"} '
                                  f'with --pipeline-model-parallel-size 2: optimizer offload is supported at PP 1 '
                                  f'only'), problems


@pytest.mark.parametrize("where, argv, ds, named", [
    ("flag", ["--zero-stage", "0"], _offload(), "--zero-stage 0"),
    ("json", [], _offload(stage=0), '"zero_optimization.stage": 0 in {path}')])
def test_offload_at_zero_stage_0_is_refused(tmp_path, where, argv, ds, named):
    problems = _problems(tmp_path, argv, ds=ds)
    named = named.format(path=tmp_path / "ds.json")
    assert problems == [f'"zero_optimization.offload_optimizer.device": "cpu" in {tmp_path / "ds.json"} needs ZeRO '
                        f"stage >= 1 (the offloaded optimizer steps ZeRO's fp32 partitions), got {named}"], problems


def test_nvme_offload_is_refused_by_name(tmp_path):
    problems = _problems(tmp_path, [], ds=_offload("nvme"))
    assert len(problems) == 1 and problems[0].startswith(
        f'"zero_optimization.offload_optimizer.device": "nvme" in {tmp_path / "ds.json"}: ZeRO-Infinity\'s NVMe '
        f'offload of the optimizer is not built in megatron_ds'), problems


def test_malformed_offload_blocks_are_refused(tmp_path):
    assert _problems(tmp_path, [], ds={"zero_optimization": {"offload_optimizer": "cpu"}}) == [
        f'"zero_optimization.offload_optimizer": "cpu" in {tmp_path / "ds.json"} must be an object, e.g. '
        f'{{"device": "cpu"}}']
    assert _problems(tmp_path, [], ds=_offload("gpu")) == [
        f'"zero_optimization.offload_optimizer.device": "gpu" in {tmp_path / "ds.json"} must be "none", "cpu" or '
        f'"nvme"']


def test_cpu_optimizer_with_sgd_is_refused(tmp_path):
    assert _problems(tmp_path, ["--cpu-optimizer", "--optimizer", "sgd"]) == [
        "--cpu-optimizer (DeepSpeed's CPU Adam, AdamW) conflicts with --optimizer sgd; drop one"]
    problems = _problems(tmp_path, ["--optimizer", "sgd"], ds=_offload())
    assert len(problems) == 1, problems
    assert "with --optimizer sgd: DeepSpeed's ZeRO-Offload steps with its CPU Adam" in problems[0], problems


def test_cpu_optimizer_without_offload_is_refused_on_a_gpu(tmp_path):
    """For a run on GPUs (tools/plan.py's cluster: resolve with on_this_host=False) CPU Adam needs the offload."""
    def resolve_for_gpus(argv):
        flags, problems = parse_flags(build_parser(), TINY_MODEL + argv)
        assert not problems
        return resolve(flags, 1, on_this_host=False)

    with pytest.raises(ArgumentsError) as raised:
        resolve_for_gpus(["--cpu-optimizer"])
    assert raised.value.problems == [
        "--cpu-optimizer without optimizer offload on a GPU run: DeepSpeed's CPU Adam steps parameters in CPU memory; "
        'add "zero_optimization": {"offload_optimizer": {"device": "cpu"}} to a DeepSpeed JSON (--deepspeed_config) '
        "(or drop --cpu-optimizer)"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ArgumentsError, match=re.escape(f"to {path} (or drop --cpu-optimizer)")):
        resolve_for_gpus(["--cpu-optimizer", "--deepspeed_config", str(path)])
    path.write_text(json.dumps(_offload(stage=2)))
    assert resolve_for_gpus(["--cpu-optimizer", "--deepspeed_config", str(path)]).cpu_adam


# --- CPU Adam as built ------------------------------------------------------------------------------------

def test_cpu_adam_as_built_steps_like_torch_adamw():
    """The wiring: two groups (weight decay on the >1-D parameters only), lr, betas, eps, AdamW mode."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    args = types.SimpleNamespace(optimizer="adam", lr=1e-2, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6,
                                 weight_decay=0.1, fusion_backend="auto", cpu_adam=True)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3))

    ours, reference = model(), model()
    cpu_adam = build_optimizer(ours, args, "cpu")
    assert isinstance(cpu_adam, DeepSpeedCPUAdam) and cpu_adam.adam_w_mode
    assert [group["weight_decay"] for group in cpu_adam.param_groups] == [0.1, 0.0]
    torch_adamw = torch.optim.AdamW(parameter_groups(reference, 0.1), lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                                    fused=False, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        batch = torch.randn(4, 7, generator=generator)
        for net, optimizer in ((ours, cpu_adam), (reference, torch_adamw)):
            net(batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours[0].weight, model()[0].weight)  # the steps moved the weights
