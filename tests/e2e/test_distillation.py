"""Knowledge distillation (--kd) in real runs: a teacher trained at TP 2 read into students at TP 1 x PP 1, TP 2 x
PP 1 and TP 1 x PP 2 (the same losses), the first iteration's two terms as an independent computation in this
process gives them, a teacher in Megatron-DeepSpeed's format, every pipeline schedule, bf16, a resume, a teacher
equal to the student."""
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from tests.support.distillation import MODEL, reference_kl
from tests.support.distributed import run_distributed
from tests.support.launch import assert_succeeded

TEACHER_LAYERS, STUDENT_LAYERS, ITERATIONS = 3, 2, 4
KD = ["--kd", "--kd-alpha-ce", "0.5", "--kd-beta-ce", "4", "--kd-temp", "2"]


def _kd_losses(output):
    """{iteration: kd loss} of a run's iteration lines."""
    return {int(it): float(value) for it, value in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*? kd loss: (\S+) \|",
                                                               output)}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 3-layer teacher trained at TP 2 (lr 1e-2: far from a fresh student)."""
    from tests.support.launch import launch
    folder = tmp_path_factory.mktemp("teacher")
    result = launch(2, MODEL + ["--num-layers", str(TEACHER_LAYERS), "--train-iters", "6", "--lr", "1e-2",
                                "--tensor-model-parallel-size", "2", "--save", str(folder)])
    assert_succeeded(result, tail=4000)
    return folder


def student_flags(teacher_folder, tp=1, pp=1):
    return MODEL + ["--num-layers", str(STUDENT_LAYERS), "--train-iters", str(ITERATIONS), "--lr", "1e-3",
                    "--eval-interval", "2", "--eval-iters", "1", "--tensor-model-parallel-size", str(tp),
                    "--pipeline-model-parallel-size", str(pp), "--load-teacher", str(teacher_folder), *KD]


@pytest.fixture(scope="module")
def straight(teacher):
    """The distillation at TP 1 x PP 1: (lm losses, kd losses, output)."""
    from tests.support.launch import launch, losses
    result = launch(1, student_flags(teacher))
    assert_succeeded(result, tail=4000)
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


def test_the_first_iteration_is_the_independent_computation(straight, teacher, tmp_path):
    lm, kd, output = straight
    assert "knowledge distillation: teacher" in output and "read resharded to TP 1" in output
    out = tmp_path / "reference.json"
    run_distributed(_first_iteration_by_hand, 1, student_flags(teacher), teacher, out)
    reference = json.loads(out.read_text())
    assert lm[1] == pytest.approx(reference["lm"], rel=2e-6) and kd[1] == pytest.approx(reference["kd"], rel=2e-6), \
        (lm, kd, reference)
    assert kd[1] > 0.05  # the teacher differs from the fresh student: the term matters


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2pp2"])
def test_every_layout_distils_as_one_rank(straight, teacher, tp, pp):
    """The teacher (saved at TP 2) read resharded into each student layout; the losses of 4 iterations (an Adam step
    on the distillation term's gradient between each, an evaluation after the second) as at TP 1 x PP 1."""
    from tests.support.launch import launch, losses
    lm, kd, _ = straight
    result = launch(tp * pp, student_flags(teacher, tp, pp))
    assert_succeeded(result, tail=4000)
    assert sorted(losses(result.stdout)) == list(range(1, ITERATIONS + 1))
    for iteration in lm:
        assert losses(result.stdout)[iteration] == pytest.approx(lm[iteration], rel=1e-5), result.stdout[-3000:]
        assert _kd_losses(result.stdout)[iteration] == pytest.approx(kd[iteration], rel=1e-4), result.stdout[-3000:]
    assert "validation loss at iteration 2" in result.stdout
    if pp == 2:  # each stage runs its share of the teacher
        assert "on pipeline stage 0 of rank 0: teacher layer 1," in result.stdout
        assert f"on pipeline stage 1 of rank {tp}: teacher layers 2-3," in result.stdout


def test_a_megatron_deepspeed_teacher_distils_as_ours(straight, teacher, tmp_path):
    """The same teacher written in Megatron-DeepSpeed's format (tools/convert_checkpoint.py --to-megatron-deepspeed,
    at TP 1 x PP 3: its layer files) gives the same run."""
    from megatron_ds.conversion import convert_cli as cli
    from tests.support.launch import launch, losses
    lm, kd, _ = straight
    assert cli.main(["--to-megatron-deepspeed", "--load", str(teacher), "--save", str(tmp_path / "mds"),
                     "--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "3"]) == 0
    result = launch(1, student_flags(tmp_path / "mds"))
    assert_succeeded(result, tail=4000)
    assert "Megatron-DeepSpeed checkpoint (version 3.0, TP 1 x PP 3" in result.stdout
    for iteration in lm:
        assert losses(result.stdout)[iteration] == pytest.approx(lm[iteration], rel=1e-5)
        assert _kd_losses(result.stdout)[iteration] == pytest.approx(kd[iteration], rel=1e-4)


def test_a_teacher_that_does_not_fit_is_named(teacher):
    from tests.support.launch import launch
    result = launch(1, student_flags(teacher) + ["--num-layers-teacher", "12", "--hidden-size-teacher", "64"])
    assert result.returncode != 0
    assert "--num-layers-teacher 12: the teacher's checkpoint has 3" in result.stdout
    assert "--hidden-size-teacher" not in result.stdout.split("does not fit this run")[-1]


def test_a_distillation_run_resumes_exactly_and_saves_no_teacher(straight, teacher, tmp_path):
    """PP 2 saved at iteration 2 (--exit-interval) and launched again: the teacher read anew, iterations 3 and 4 as
    the straight run's; the checkpoint holds the student's weights only."""
    from megatron_ds.checkpointing import discovery, state
    from tests.support.launch import launch, losses
    lm, kd, _ = straight
    flags = student_flags(teacher, 1, 2) + ["--save", str(tmp_path / "run")]
    first = launch(2, flags + ["--exit-interval", "2"])
    assert_succeeded(first, tail=3000)
    assert sorted(losses(first.stdout)) == [1, 2], first.stdout[-3000:]
    second = launch(2, flags)
    assert_succeeded(second, tail=3000)
    assert "resuming at iteration 2" in second.stdout, second.stdout[-3000:]
    for iteration in (3, 4):
        assert losses(second.stdout)[iteration] == pytest.approx(lm[iteration], rel=1e-5)
        assert _kd_losses(second.stdout)[iteration] == pytest.approx(kd[iteration], rel=1e-4)
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "run"))
    saved = state.read_full_state(str(tmp_path / "run" / tag), metadata, with_optimizer=False).weights
    assert {name.split(".")[2] for name in saved if name.startswith("decoder.layers.")} == {"0", "1"}



@pytest.mark.parametrize("precision", [[], ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]],
                         ids=["fp32", "fp8-delayed"])
def test_a_teacher_equal_to_the_student_at_step_0_changes_nothing(tmp_path, precision):
    """The student starts from the teacher's checkpoint (--load with --finetune) and distils from it with
    --kd-alpha-ce 1 --kd-beta-ce 0: the first iteration's KL term is 0, and every iteration's loss is the plain run's
    from the same start, bit for bit. Under FP8 delayed scaling the teacher quantises at the scales its checkpoint
    saved, as the student does."""
    from tests.support.launch import launch, losses
    model = MODEL + ["--num-layers", "2", *precision]
    start = launch(1, model + ["--train-iters", "2", "--lr", "1e-2", "--save", str(tmp_path)])
    assert_succeeded(start, tail=3000)
    run = model + ["--train-iters", "3", "--lr", "1e-3", "--load", str(tmp_path), "--finetune"]
    plain = launch(1, run)
    distilled = launch(1, run + ["--kd", "--load-teacher", str(tmp_path), "--kd-alpha-ce", "1", "--kd-beta-ce", "0"])
    assert_succeeded(plain, tail=3000)
    assert_succeeded(distilled, tail=3000)
    assert _kd_losses(distilled.stdout)[1] == 0.0
    assert losses(distilled.stdout) == losses(plain.stdout) and sorted(losses(plain.stdout)) == [1, 2, 3]


def test_every_pipeline_schedule_distils_as_1f1b(teacher):
    """A 4-layer student at PP 2 (8 micro-batches) under ZB-H1, the interleaved schedule (2 chunks per rank) and
    DualPipeV (whose rank 0 holds the embedding and the head: the teacher's go with them): 1F1B's losses."""
    from tests.support.launch import launch, losses
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


def test_bf16_teacher_hidden_states_cross_the_pipeline_as_16_bit_integers(teacher):
    """In bf16 the teacher's hidden states travel as int16 views: PP 2 distils as PP 1 (within bf16's rounding of
    the two layouts' reductions)."""
    from tests.support.launch import launch, losses
    runs = [launch(pp, student_flags(teacher, 1, pp) + ["--bf16"]) for pp in (1, 2)]
    for run in runs:
        assert_succeeded(run, tail=3000)
    (lm, kd), (lm2, kd2) = ((losses(run.stdout), _kd_losses(run.stdout)) for run in runs)
    assert sorted(lm2) == list(range(1, ITERATIONS + 1)) and kd2[1] == kd[1]
    for iteration in lm:
        assert lm2[iteration] == pytest.approx(lm[iteration], rel=1e-4)
        assert kd2[iteration] == pytest.approx(kd[iteration], rel=1e-3)
