"""ParallelLayout: the derived sizes, and one rule set that pretrain.py's argument checks and the planner share:
the same random layouts get the same verdict from both."""
import random

import pytest

from megatron_ds.arguments import ArgumentsError, build_parser, parse_flags
from megatron_ds.arguments.resolve import resolve
from megatron_ds.core.parallel_layout import ModelShape, ParallelLayout
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.planning.model import Layout, ModelSpec, layout_errors


def test_derived_sizes():
    layout = ParallelLayout(world_size=48, tensor=2, pipeline=3, ulysses=2, expert=4)
    assert (layout.model_parallel_size, layout.data_parallel, layout.sequence_data_parallel) == (12, 4, 8)
    assert layout.stage_ranks == 16
    assert layout.expert_data_parallel == 2 * 8 // 4
    assert ParallelLayout(48, tensor=2, pipeline=3, ulysses=2, expert=4,
                          expert_tensor_parallel=True).expert_data_parallel == 2
    with pytest.raises(ValueError, match="TP 2 x Ulysses SP 2 x PP 3 = 12 does not divide the world size 50"):
        ParallelLayout(world_size=50, tensor=2, pipeline=3, ulysses=2).data_parallel


def test_problems_name_the_flags_and_the_planner_reasons():
    shape = ModelShape(num_layers=3, num_attention_heads=6, num_query_groups=6, ffn_hidden_size=30, seq_length=33)
    problems = ParallelLayout(world_size=12, tensor=4, pipeline=2, sequence_parallel=True).problems(shape)
    assert [problem.reason for problem in problems] == [
        "TP x Ulysses SP x CP x PP does not divide the world size", "heads not divisible by TP",
        "kv heads not divisible by TP", "FFN not divisible by TP", "layers not divisible by PP",
        "sequence not divisible by TP (SP)"]
    assert problems[0].message == ("--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 2 = 8 does not "
                                   "divide the world size 12 (the number of launched ranks)")
    assert problems[4].detail == "3 layers over PP 2"


def test_virtual_stages_split_the_layers():
    shape = ModelShape(num_layers=8, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64, seq_length=16)
    assert ParallelLayout(4, pipeline=2, virtual_stages=4).problems(shape) == []
    assert [p.reason for p in ParallelLayout(4, pipeline=2, virtual_stages=3).problems(shape)] == [
        "layers not divisible by PP x virtual stages"]


def random_case(rng):
    heads = rng.choice([4, 8, 8, 12, 16])
    experts = rng.choice([1, 1, 2, 4])
    tp, pp, ulysses = rng.choice([1, 2, 4]), rng.choice([1, 2, 2, 3, 4]), rng.choice([1, 1, 1, 2, 4])
    world = tp * pp * ulysses * rng.choice([1, 2, 4]) if rng.random() < 0.8 else rng.choice([1, 2, 4, 6, 12, 32])
    return dict(world=world, tp=tp, pp=pp, ulysses=ulysses, heads=heads,
                kv_heads=rng.choice([d for d in range(1, heads + 1) if heads % d == 0]),
                layers=rng.choice([2, 3, 4, 4, 6, 8, 8]), seq=rng.choice([16, 24, 30, 32, 32]),
                ffn=rng.choice([60, 96, 128, 128]), sequence_parallel=tp > 1 and rng.random() < 0.3,
                experts=experts, ep=rng.choice([1, 2, 4]) if experts > 1 else 1,
                expert_tp=experts > 1 and rng.random() < 0.3, interval=rng.choice([1, 2]),
                micro=rng.choice([1, 2]), global_batch=rng.choice([8, 12, 16, 32]), zero=rng.choice([0, 1, 1, 2, 3]))


def launcher_accepts(case):
    """pretrain.py's resolution of the flags (not this host's files)."""
    argv = (f"--num-layers {case['layers']} --hidden-size {case['heads'] * 8} --num-attention-heads {case['heads']} "
            f"--num-key-value-heads {case['kv_heads']} --ffn-hidden-size {case['ffn']} --seq-length {case['seq']} "
            f"--vocab-size 128 --train-iters 1 --micro-batch-size {case['micro']} "
            f"--global-batch-size {case['global_batch']} --zero-stage {case['zero']} "
            f"--tensor-model-parallel-size {case['tp']} --pipeline-model-parallel-size {case['pp']} "
            f"--ds-sequence-parallel-size {case['ulysses']} --num-experts {case['experts']} "
            f"--moe-expert-parallel-size {case['ep']} --expert-interval {case['interval']}").split()
    argv += (["--sequence-parallel"] * case["sequence_parallel"]
             + ["--enable-expert-tensor-parallelism"] * case["expert_tp"])
    flags, problems = parse_flags(build_parser(), argv)
    assert not problems, problems
    try:
        resolve(flags, case["world"], on_this_host=False)
    except ArgumentsError:
        return False
    return True


def planner_accepts(case):
    """The planner's model (a TransformerConfig, which checks the experts against EP) and layout rules."""
    try:
        config = TransformerConfig(
            num_layers=case["layers"], hidden_size=case["heads"] * 8, num_attention_heads=case["heads"],
            num_query_groups=case["kv_heads"], ffn_hidden_size=case["ffn"], num_experts=(case["experts"],),
            expert_interval=case["interval"], moe_expert_parallel_size=case["ep"],
            moe_expert_tensor_parallel=case["expert_tp"])
    except ValueError:
        return False
    model = ModelSpec(config, 128, 128, case["seq"], case["seq"], True)
    model_parallel = case["tp"] * case["ulysses"] * case["pp"]
    layout = Layout(case["tp"], case["pp"], max(case["world"] // model_parallel, 1), case["micro"],
                    case["global_batch"], case["sequence_parallel"], zero_stage=case["zero"], ulysses=case["ulysses"])
    return not layout_errors(model, layout, world_size=case["world"])


def test_the_launcher_and_the_planner_give_200_random_layouts_the_same_verdict():
    """Megatron's SP at TP 1 is not drawn: pretrain.py refuses it, the planner plans it with a warning."""
    rng = random.Random(25)
    cases = [random_case(rng) for _ in range(200)]
    verdicts = [(launcher_accepts(case), planner_accepts(case)) for case in cases]
    disagreements = [(case, launcher) for case, (launcher, planner) in zip(cases, verdicts) if launcher != planner]
    assert disagreements == []
    accepted = sum(launcher for launcher, _ in verdicts)
    assert 20 <= accepted <= 180, accepted   # both verdicts are drawn often enough to mean something
