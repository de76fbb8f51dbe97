"""Knowledge distillation (--kd): the vocabulary-parallel KL term against torch's, the teacher's layers placed with
the student's, the flags refused by name, and real runs: a teacher trained at TP 2 read into students at TP 1 x
PP 1, TP 2 x PP 1 and TP 1 x PP 2 (the same losses), the first iteration's two terms as an independent computation
in this process gives them, and a teacher in Megatron-DeepSpeed's format."""
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.arguments import ArgumentsError
from megatron_ds.core.parallel_layout import teacher_layers_on
from megatron_ds.core.tensor_parallel.kl_divergence import vocab_parallel_kl_divergence
from tests.distributed import run_distributed

MODEL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
         "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--mock-data", "--log-interval", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
TEACHER_LAYERS, STUDENT_LAYERS, ITERATIONS = 3, 2, 4
KD = ["--kd", "--kd-alpha-ce", "0.5", "--kd-beta-ce", "4", "--kd-temp", "2"]


def reference_kl(student, teacher, temperature):
    """T^2 KL(softmax(teacher / T) || softmax(student / T)) per token, as Megatron-DeepSpeed computes it."""
    log_student, log_teacher = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    return temperature ** 2 * F.kl_div(log_student, log_teacher, log_target=True, reduction="none").sum(-1)


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


# --- real runs ----------------------------------------------------------------------------------------------

def _kd_losses(output):
    """{iteration: kd loss} of a run's iteration lines."""
    return {int(it): float(value) for it, value in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*? kd loss: (\S+) \|",
                                                               output)}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 3-layer teacher trained at TP 2 (lr 1e-2: far from a fresh student)."""
    from tests.launch import launch
    folder = tmp_path_factory.mktemp("teacher")
    result = launch(2, MODEL + ["--num-layers", str(TEACHER_LAYERS), "--train-iters", "6", "--lr", "1e-2",
                                "--tensor-model-parallel-size", "2", "--save", str(folder)])
    assert result.returncode == 0, result.stdout[-4000:]
    return folder


def student_flags(teacher_folder, tp=1, pp=1):
    return MODEL + ["--num-layers", str(STUDENT_LAYERS), "--train-iters", str(ITERATIONS), "--lr", "1e-3",
                    "--eval-interval", "2", "--eval-iters", "1", "--tensor-model-parallel-size", str(tp),
                    "--pipeline-model-parallel-size", str(pp), "--load-teacher", str(teacher_folder), *KD]


@pytest.fixture(scope="module")
def straight(teacher):
    """The distillation at TP 1 x PP 1: (lm losses, kd losses, output)."""
    from tests.launch import launch, losses
    result = launch(1, student_flags(teacher))
    assert result.returncode == 0, result.stdout[-4000:]
    return losses(result.stdout), _kd_losses(result.stdout), result.stdout


def _first_iteration_by_hand(flags, teacher_folder, out):
    """The first iteration's lm loss and distillation term computed here: the student as the run builds it before
    any step, the teacher read whole (generation.build_model), torch's kl_div and cross entropy in float64, over
    the run's first global batch."""
    from megatron_ds.arguments import parse_args
    from megatron_ds.checkpointing import discovery, state
    from megatron_ds.core.models.gpt import GPTModel
    from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_ds.data.builder import batch_iterator, build_datasets
    from megatron_ds.inference import generation
    from megatron_ds.training import initialize
    args = parse_args(flags)
    initialize.initialize_groups(args)
    model_parallel_cuda_manual_seed(args.seed)
    student = GPTModel(args.model, args.padded_vocab_size, args.max_position_embeddings)
    tag, metadata, _ = discovery.resolve_checkpoint(str(teacher_folder))
    teacher = generation.build_model(state.read_full_state(os.path.join(teacher_folder, tag), metadata,
                                                           with_optimizer=False))
    batches = batch_iterator(build_datasets(args.data)["train"], args.data, 0, torch.device("cpu"))
    lm, kd = [], []
    for _ in range(args.global_batch_size // args.micro_batch_size):
        inputs, labels = next(batches)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        labels = labels[0] if isinstance(labels, (tuple, list)) else labels
        with torch.no_grad():
            student_logits, teacher_logits = student(*inputs).double(), teacher(*inputs).double()
        lm.append(F.cross_entropy(student_logits.flatten(0, 1), labels.t().flatten()).item())
        kd.append(reference_kl(student_logits, teacher_logits, args.kd_temp).mean().item())
    with open(out, "w") as file:
        json.dump({"lm": sum(lm) / len(lm), "kd": sum(kd) / len(kd)}, file)


@pytest.mark.e2e
def test_the_first_iteration_is_the_independent_computation(straight, teacher, tmp_path):
    lm, kd, output = straight
    assert "knowledge distillation: teacher" in output and "read resharded to TP 1" in output
    out = tmp_path / "reference.json"
    run_distributed(_first_iteration_by_hand, 1, student_flags(teacher), teacher, out)
    reference = json.loads(out.read_text())
    assert lm[1] == pytest.approx(reference["lm"], rel=2e-6) and kd[1] == pytest.approx(reference["kd"], rel=2e-6), \
        (lm, kd, reference)
    assert kd[1] > 0.05  # the teacher differs from the fresh student: the term matters


@pytest.mark.e2e
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2pp2"])
def test_every_layout_distils_as_one_rank(straight, teacher, tp, pp):
    """The teacher (saved at TP 2) read resharded into each student layout; the losses of 4 iterations (an Adam step
    on the distillation term's gradient between each, an evaluation after the second) as at TP 1 x PP 1."""
    from tests.launch import launch, losses
    lm, kd, _ = straight
    result = launch(tp * pp, student_flags(teacher, tp, pp))
    assert result.returncode == 0, result.stdout[-4000:]
    assert sorted(losses(result.stdout)) == list(range(1, ITERATIONS + 1))
    for iteration in lm:
        assert losses(result.stdout)[iteration] == pytest.approx(lm[iteration], rel=1e-5), result.stdout[-3000:]
        assert _kd_losses(result.stdout)[iteration] == pytest.approx(kd[iteration], rel=1e-4), result.stdout[-3000:]
    assert "validation loss at iteration 2" in result.stdout
    if pp == 2:  # each stage runs its share of the teacher
        assert "on pipeline stage 0 of rank 0: teacher layer 1," in result.stdout
        assert f"on pipeline stage 1 of rank {tp}: teacher layers 2-3," in result.stdout


@pytest.mark.e2e
def test_a_megatron_deepspeed_teacher_distils_as_ours(straight, teacher, tmp_path):
    """The same teacher written in Megatron-DeepSpeed's format (tools/convert_checkpoint.py --to-megatron-deepspeed,
    at TP 1 x PP 3: its layer files) gives the same run."""
    from megatron_ds.conversion import convert_cli as cli
    from tests.launch import launch, losses
    lm, kd, _ = straight
    assert cli.main(["--to-megatron-deepspeed", "--load", str(teacher), "--save", str(tmp_path / "mds"),
                     "--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "3"]) == 0
    result = launch(1, student_flags(tmp_path / "mds"))
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Megatron-DeepSpeed checkpoint (version 3.0, TP 1 x PP 3" in result.stdout
    for iteration in lm:
        assert losses(result.stdout)[iteration] == pytest.approx(lm[iteration], rel=1e-5)
        assert _kd_losses(result.stdout)[iteration] == pytest.approx(kd[iteration], rel=1e-4)


@pytest.mark.e2e
def test_a_teacher_that_does_not_fit_is_named(teacher):
    from tests.launch import launch
    result = launch(1, student_flags(teacher) + ["--num-layers-teacher", "12", "--hidden-size-teacher", "64"])
    assert result.returncode != 0
    assert "--num-layers-teacher 12: the teacher's checkpoint has 3" in result.stdout
    assert "--hidden-size-teacher" not in result.stdout.split("does not fit this run")[-1]


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


@pytest.mark.e2e
def test_a_distillation_run_resumes_exactly_and_saves_no_teacher(straight, teacher, tmp_path):
    """PP 2 saved at iteration 2 (--exit-interval) and launched again: the teacher read anew, iterations 3 and 4 as
    the straight run's; the checkpoint holds the student's weights only."""
    from megatron_ds.checkpointing import discovery, state
    from tests.launch import launch, losses
    lm, kd, _ = straight
    flags = student_flags(teacher, 1, 2) + ["--save", str(tmp_path / "run")]
    first = launch(2, flags + ["--exit-interval", "2"])
    assert first.returncode == 0 and sorted(losses(first.stdout)) == [1, 2], first.stdout[-3000:]
    second = launch(2, flags)
    assert second.returncode == 0 and "resuming at iteration 2" in second.stdout, second.stdout[-3000:]
    for iteration in (3, 4):
        assert losses(second.stdout)[iteration] == pytest.approx(lm[iteration], rel=1e-5)
        assert _kd_losses(second.stdout)[iteration] == pytest.approx(kd[iteration], rel=1e-4)
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "run"))
    saved = state.read_full_state(str(tmp_path / "run" / tag), metadata, with_optimizer=False).weights
    assert {name.split(".")[2] for name in saved if name.startswith("decoder.layers.")} == {"0", "1"}



@pytest.mark.e2e
def test_a_teacher_equal_to_the_student_at_step_0_changes_nothing(tmp_path):
    """The student starts from the teacher's checkpoint (--load with --finetune) and distils from it with
    --kd-alpha-ce 1 --kd-beta-ce 0: the first iteration's KL term is 0, and every iteration's loss is the plain run's
    from the same start, bit for bit."""
    from tests.launch import launch, losses
    start = launch(1, MODEL + ["--num-layers", "2", "--train-iters", "2", "--lr", "1e-2", "--save", str(tmp_path)])
    assert start.returncode == 0, start.stdout[-3000:]
    run = MODEL + ["--num-layers", "2", "--train-iters", "3", "--lr", "1e-3", "--load", str(tmp_path), "--finetune"]
    plain = launch(1, run)
    distilled = launch(1, run + ["--kd", "--load-teacher", str(tmp_path), "--kd-alpha-ce", "1", "--kd-beta-ce", "0"])
    assert plain.returncode == 0 and distilled.returncode == 0, distilled.stdout[-3000:]
    assert _kd_losses(distilled.stdout)[1] == 0.0
    assert losses(distilled.stdout) == losses(plain.stdout) and sorted(losses(plain.stdout)) == [1, 2, 3]


@pytest.mark.e2e
def test_every_pipeline_schedule_distils_as_1f1b(teacher):
    """A 4-layer student at PP 2 (8 micro-batches) under ZB-H1, the interleaved schedule (2 chunks per rank) and
    DualPipeV (whose rank 0 holds the embedding and the head: the teacher's go with them): 1F1B's losses."""
    from tests.launch import launch, losses
    flags = student_flags(teacher, 1, 2)
    flags[flags.index("--num-layers") + 1], flags[flags.index("--global-batch-size") + 1] = "4", "8"
    runs = {}
    interleaved = ["--num-virtual-stages-per-pipeline-rank", "2"]
    for schedule, extra in (("1f1b", []), ("zbh1", []), ("interleaved", interleaved), ("dualpipev", [])):
        result = launch(2, flags + ["--pipeline-schedule", schedule, *extra])
        assert result.returncode == 0, (schedule, result.stdout[-3000:])
        runs[schedule] = (losses(result.stdout), _kd_losses(result.stdout))
    lm, kd = runs.pop("1f1b")
    assert sorted(lm) == list(range(1, ITERATIONS + 1)) and kd[1] > 0.05
    for schedule, (other_lm, other_kd) in runs.items():
        for iteration in lm:
            assert other_lm[iteration] == pytest.approx(lm[iteration], rel=1e-6), (schedule, other_lm, lm)
            assert other_kd[iteration] == pytest.approx(kd[iteration], rel=1e-5), (schedule, other_kd, kd)


@pytest.mark.e2e
def test_bf16_teacher_hidden_states_cross_the_pipeline_as_16_bit_integers(teacher):
    """In bf16 the teacher's hidden states travel as int16 views: PP 2 distils as PP 1 (within bf16's rounding of
    the two layouts' reductions)."""
    from tests.launch import launch, losses
    runs = [launch(pp, student_flags(teacher, 1, pp) + ["--bf16"]) for pp in (1, 2)]
    assert all(run.returncode == 0 for run in runs), runs[-1].stdout[-3000:]
    (lm, kd), (lm2, kd2) = ((losses(run.stdout), _kd_losses(run.stdout)) for run in runs)
    assert sorted(lm2) == list(range(1, ITERATIONS + 1)) and kd2[1] == kd[1]
    for iteration in lm:
        assert lm2[iteration] == pytest.approx(lm[iteration], rel=1e-4)
        assert kd2[iteration] == pytest.approx(kd[iteration], rel=1e-3)
