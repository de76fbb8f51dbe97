"""Knowledge distillation (--kd): the vocabulary-parallel KL term against torch's, the teacher's layers placed with
the student's, the flags refused by name, the teacher's memory as the planner counts it. Real runs:
tests/e2e/test_distillation.py."""
import pytest
import torch

from megatron_ds.arguments import ArgumentsError
from megatron_ds.core.parallel_layout import teacher_layers_on
from megatron_ds.core.tensor_parallel.kl_divergence import vocab_parallel_kl_divergence
from tests.support.distillation import MODEL, reference_kl
from tests.support.distributed import run_distributed


def test_kl_divergence_and_its_gradient_are_torchs():
    torch.manual_seed(0)
    student = torch.randn(6, 3, 40, dtype=torch.float64, requires_grad=True)
    teacher, weights = torch.randn(6, 3, 40, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    ours = vocab_parallel_kl_divergence(student, teacher, 1.5, chunk_rows=4)  # 18 tokens: chunks of 4 and 2
    expected = reference_kl(student, teacher, 1.5)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    ours_grad, = torch.autograd.grad((ours * weights).sum(), student)
    expected_grad, = torch.autograd.grad((expected * weights).sum(), student)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_bf16_logits_get_a_bf16_gradient_of_the_float32_term():
    torch.manual_seed(1)
    student = torch.randn(4, 2, 24, dtype=torch.bfloat16, requires_grad=True)
    teacher = torch.randn(4, 2, 24, dtype=torch.bfloat16)
    ours = vocab_parallel_kl_divergence(student, teacher, 2.0, chunk_rows=3)
    upcast = student.detach().float().requires_grad_()
    expected = reference_kl(upcast, teacher.float(), 2.0)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    ours_grad, = torch.autograd.grad(ours.sum(), student)
    expected_grad, = torch.autograd.grad(expected.sum(), upcast)
    assert ours_grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours_grad.float(), expected_grad, rtol=1e-2, atol=1e-3)


def test_a_teacher_equal_to_the_student_adds_nothing():
    logits = torch.randn(5, 2, 30, dtype=torch.float64, requires_grad=True)
    kl = vocab_parallel_kl_divergence(logits, logits.detach().clone(), 2.0)
    assert torch.equal(kl, torch.zeros_like(kl))
    grad, = torch.autograd.grad(kl.sum(), logits)
    assert torch.equal(grad, torch.zeros_like(grad))


def _kl_over_two_tensor_parallel_ranks():
    import torch.distributed as dist

    from megatron_ds.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)  # the same full logits on both ranks; each keeps its half of the vocabulary
    student = torch.randn(5, 2, 48, dtype=torch.float64, requires_grad=True)
    teacher, weights = torch.randn(5, 2, 48, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    half = slice(24 * dist.get_rank(), 24 * (dist.get_rank() + 1))
    local = student.detach()[..., half].clone().requires_grad_()
    ours = vocab_parallel_kl_divergence(local, teacher[..., half], 3.0, chunk_rows=3)
    expected = reference_kl(student, teacher, 3.0)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    ours_grad, = torch.autograd.grad((ours * weights).sum(), local)
    expected_grad, = torch.autograd.grad((expected * weights).sum(), student)
    torch.testing.assert_close(ours_grad, expected_grad[..., half], rtol=1e-12, atol=1e-12)


def test_kl_divergence_over_a_vocabulary_split_across_two_ranks():
    run_distributed(_kl_over_two_tensor_parallel_ranks, 2)


@pytest.mark.parametrize("students, teachers", [(2, 3), (10, 12), (4, 2), (24, 24)])
def test_each_teacher_layer_rides_once_in_order_and_in_proportion(students, teachers):
    stages = [range(1, students // 2 + 1), range(students // 2 + 1, students + 1)]
    shares = [teacher_layers_on(stage, students, teachers) for stage in stages]
    assert shares[0] + shares[1] == list(range(1, teachers + 1))
    assert abs(len(shares[0]) - teachers / 2) <= 1


def _errors(argv):
    from megatron_ds.arguments import parse_args
    with pytest.raises(ArgumentsError) as raised:
        parse_args(MODEL + ["--num-layers", "2", "--train-iters", "1", *argv])
    return str(raised.value)


def test_distillation_flags_are_refused_by_name():
    assert "--kd needs --load-teacher" in _errors(["--kd"])
    assert "--load-teacher / --num-layers-teacher without --kd" in _errors(["--load-teacher", "x",
                                                                           "--num-layers-teacher", "3"])
    message = _errors(["--kd", "--load-teacher", "x", "--kd-temp", "0", "--num-experts-teacher", "4"])
    assert "--kd-temp must be positive, got 0.0" in message
    assert "--num-experts-teacher 4: a Mixture-of-Experts teacher is not built" in message
    assert "--mos: Mixture-of-Students" in _errors(["--mos"])


# --- the planner ------------------------------------------------------------------------------------------

def _planned_memory(*flags):
    from megatron_ds.arguments import parse_flags, raise_if_invalid
    from megatron_ds.planning import plan_cli as cli
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--bf16",
            "--pipeline-model-parallel-size", "2", "--world-size", "2", *flags]
    args, problems = parse_flags(cli.build_plan_parser(), argv)
    raise_if_invalid(problems)
    return cli.run(args)[0]["plan"]


def test_the_planner_counts_the_teacher_by_hand():
    """A 4-layer teacher (h 64, GPT-2 layers: 12 h^2 + 13 h = 49,984 parameters each) beside a 2-layer student at
    PP 2, bf16, 4 micro-batches of 2 x 32 tokens: stage 0 holds teacher layers 1-2 and the embedding
    (128 x 64 + 32 x 64), sends the teacher's hidden states (2 x 32 x 2 x 64 bytes) of its 2 micro-batches in
    flight; stage 1 holds layers 3-4, the final norm and the tied head's copy, receives 1 micro-batch's, and keeps
    the teacher's logits and the term's four fp32 temporaries of one chunk (all 64 tokens here): 64 x 128 x
    (2 + 16) bytes."""
    plan = _planned_memory("--kd", "--load-teacher", "x", "--num-layers-teacher", "4", "--hidden-size-teacher", "64",
                           "--num-attention-heads-teacher", "4")
    layer, embedding, message = 49_984, 128 * 64 + 32 * 64, 2 * 32 * 2 * 64
    expected = [2 * (embedding + 2 * layer) + 2 * message,
                2 * (2 * layer + 2 * 64 + embedding) + message + 64 * 128 * 18]
    teacher = [row["teacher"] for row in plan["memory"]["per_stage"]]
    assert teacher == expected
    without = _planned_memory()["memory"]["per_stage"]
    assert [row["total"] for row in plan["memory"]["per_stage"]] == [row["total"] + t
                                                                      for row, t in zip(without, expected)]
    assert not any("teacher" in warning for warning in plan["warnings"])
    unknown = _planned_memory("--kd", "--load-teacher", "x")
    assert "the teacher's memory is not counted" in " ".join(unknown["warnings"])
    assert all(row["teacher"] == 0 for row in unknown["memory"]["per_stage"])
