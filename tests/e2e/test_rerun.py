"""--rerun-mode validate_results on real ranks (TP 2 x PP 2, dropout on): an error injected at iteration 6
(--error-injection-rate 6) into the last rank's loss. transient_error: the replay differs, the ranks exit 16
naming rank 3, nothing of iteration 6 is saved, and the next launch resumes from iteration 5 and gives the
straight run's losses. persistent_error: the replay gives the same NaN, exit 17 naming the iteration and the
global batch's samples and documents. correct_result: the replay reproduces the loss bitwise (same weights, data
and random numbers) and training goes on with the straight run's losses."""
import re

import pytest

from megatron_ds.arguments.checks import fp16_supported
from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON

FLAGS = [*COMMON, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--make-vocab-size-divisible-by", "128", "--rerun-mode", "validate_results"]
FLAGS[FLAGS.index("--hidden-dropout") + 1] = "0.1"
FLAGS[FLAGS.index("--attention-dropout") + 1] = "0.1"
INJECT = ["--error-injection-rate", "6"]
REAL_LAUNCHER = {}  # an environment of its own: torchrun itself, whose report gives each rank's exit status
_straight = []


def straight_losses():
    if not _straight:
        result = launch(4, FLAGS)
        assert_succeeded(result, tail=4000)
        _straight.append(losses(result.stdout))
    return _straight[0]


def test_a_transient_error_exits_16_naming_the_rank_and_the_next_launch_repeats_the_straight_run(tmp_path):
    save = ["--save", str(tmp_path), "--save-interval", "5"]
    failed = launch(4, FLAGS + INJECT + ["--error-injection-type", "transient_error"] + save, env=REAL_LAUNCHER)
    assert failed.returncode != 0 and "exitcode  : 16" in failed.stdout, failed.stdout[-4000:]
    message = re.search(r"megatron_ds: error: iteration 6: .*", failed.stdout)
    assert message and "the loss changed on rank(s) 3: nan, then " in message.group(0), failed.stdout[-4000:]
    assert "a transient fault of the device(s) of rank(s) 3." in message.group(0)
    assert "exiting with 16" in message.group(0)
    assert sorted(path.name for path in tmp_path.glob("global_step*")) == ["global_step5"]
    resumed = launch(4, FLAGS + save)
    assert_succeeded(resumed, tail=4000)
    trajectory = losses(resumed.stdout)
    assert sorted(trajectory) == list(range(6, 11)), resumed.stdout[-4000:]
    assert trajectory == {it: loss for it, loss in straight_losses().items() if it > 5}


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4"]],
                         ids=["tp2-pp2", "tp1-pp4"])
def test_a_persistent_error_exits_17_naming_the_iteration_and_its_samples(layout):
    """At PP 4 the middle stages read no data: the message is rank 0's, which does."""
    result = launch(4, FLAGS + layout + INJECT + ["--error-injection-type", "persistent_error"], env=REAL_LAUNCHER)
    assert result.returncode != 0 and "exitcode  : 17" in result.stdout, result.stdout[-4000:]
    assert ("iteration 6: the loss is nan, reproduced when computed again on the same ranks (loss nan both times): "
            "the data's or the model's, or a persistent fault of a device, which this layout cannot tell apart (one "
            "data-parallel replica: no other devices hold the same weights). The global batch: samples 40-47 (mock "
            "data documents [40, 41, 42, 43, 44, 45, 46, 47])") in result.stdout, result.stdout[-4000:]
    assert not re.search(r"iteration\s+6/", result.stdout)  # the iteration is never logged as done


DP2_PP2 = [*FLAGS[:FLAGS.index("--tensor-model-parallel-size")], "--pipeline-model-parallel-size", "2",
           *FLAGS[FLAGS.index("--make-vocab-size-divisible-by"):]]


@pytest.mark.parametrize("fault, program, named", [
    (INJECT + ["--error-injection-type", "persistent_error"], ("pretrain.py",), "3"),
    ([], ("-m", "tests.support.silent_corruption", "1@6:persistent"), "1"),
], ids=["injected", "real"])
def test_a_persistent_fault_is_told_from_the_data_on_the_next_replica_and_exits_16_naming_its_device(
        fault, program, named):
    """DP 2 x PP 2 (stage 0: ranks 0, 1; stage 1: ranks 2, 3), dropout on. The last rank's injected error, or rank
    1's output made NaN in every computation of iteration 6, reproduces on the same ranks; computed with each
    replica's micro-batches on the other's devices, it stays with that rank: exit 16 naming it alone."""
    result = launch(4, DP2_PP2 + fault, env=REAL_LAUNCHER, program=program)
    assert result.returncode != 0 and "exitcode  : 16" in result.stdout, result.stdout[-4000:]
    message = re.search(r"megatron_ds: error: iteration 6: the loss is nan, reproduced when computed again on the "
                        r"same ranks; computed on the next data-parallel replica's devices, (.*)", result.stdout)
    assert message and (f"a persistent fault of the device(s) of rank(s) {named}. Not saved; exiting with 16"
                        in message.group(1)), result.stdout[-4000:]


def test_a_false_alarm_is_computed_again_bitwise_and_training_goes_on():
    result = launch(4, FLAGS + INJECT + ["--error-injection-type", "correct_result"])
    assert_succeeded(result, tail=4000)
    assert ("iteration 6: an injected false alarm (--error-injection-type correct_result); computed again"
            in result.stdout)
    assert losses(result.stdout) == straight_losses()


def _reporting(flags):
    """FLAGS with --rerun-mode report_stats and extra flags."""
    reporting = FLAGS[:FLAGS.index("--rerun-mode")] + ["--rerun-mode", "report_stats"]
    return reporting + FLAGS[FLAGS.index("--rerun-mode") + 2:] + flags


def test_report_stats_computes_every_other_iteration_twice_and_trains_as_the_straight_run():
    result = launch(4, _reporting(["--rerun-stats-interval", "2"]))
    assert_succeeded(result, tail=4000)
    assert ("rerun stats to iteration 10: 5 of 5 iterations computed twice reproduced bit for bit; largest relative "
            "loss difference 0; results moved on: none") in result.stdout, result.stdout[-4000:]
    assert losses(result.stdout) == straight_losses()


def test_report_stats_names_the_rank_of_a_silent_corruption_and_trains_on_the_replay():
    """Rank 1 outputs NaN once at iteration 4: the replay does not, its step is taken, and the run gives the
    straight run's losses; the statistics name rank 1 at iteration 4."""
    result = launch(4, _reporting([]), program=("-m", "tests.support.silent_corruption", "1@4"))
    assert_succeeded(result, tail=4000)
    assert ("rerun stats to iteration 10: 9 of 10 iterations computed twice reproduced bit for bit; largest relative "
            "loss difference nan (iteration 4); results moved on: rank 1 at iteration(s) 4") in result.stdout, \
        result.stdout[-4000:]
    assert losses(result.stdout) == straight_losses()


@pytest.mark.parametrize("precision_and_zero", [
    pytest.param(["--zero-stage", "2"], id="zero2-fp32"),
    pytest.param(["--zero-stage", "0", "--fp16"], id="zero0-fp16", marks=pytest.mark.skipif(
        not fp16_supported(), reason="DeepSpeed has no fp16 on this CPU (oneDNN): pretrain.py refuses --fp16")),
])
def test_the_replay_is_bitwise_without_a_pipeline(precision_and_zero):
    """DeepSpeedEngine.step() (no pipeline engine) at DP 2: its ZeRO-2 partitions and fp16 optimizer's gradients
    dropped for the replay as an overflow drops them."""
    flags = [*COMMON, "--num-layers", "2", "--train-iters", "8", *precision_and_zero]
    flags[flags.index("--hidden-dropout") + 1] = "0.1"
    straight = launch(2, flags)
    replayed = launch(2, flags + ["--rerun-mode", "validate_results", "--error-injection-rate", "4",
                                  "--error-injection-type", "correct_result"])
    assert_succeeded(straight, tail=3000)
    assert_succeeded(replayed, tail=3000)
    assert replayed.stdout.count("an injected false alarm") == 2  # iterations 4 and 8
    assert losses(replayed.stdout) == losses(straight.stdout) and len(losses(straight.stdout)) == 8


def test_a_real_corruption_is_traced_to_the_rank_whose_output_changed_first():
    """Rank 1 (stage 0, TP rank 1) computes a NaN output once at iteration 4: stage 1 and the loss inherit it,
    the replay does not; the rank named is rank 1 alone, not the stage that received it."""
    result = launch(4, FLAGS, env=REAL_LAUNCHER, program=("-m", "tests.support.silent_corruption", "1@4"))
    assert result.returncode != 0 and "exitcode  : 16" in result.stdout, result.stdout[-4000:]
    assert ("iteration 4: the loss is nan; computed again from the same state, the output of pipeline stage 0 changed "
            "on rank(s) 1 (the ranks downstream of it computed on what they received): a transient fault of the "
            "device(s) of rank(s) 1.") in result.stdout, result.stdout[-4000:]


def test_a_fault_in_the_backward_pass_is_caught_before_the_step_and_traced_to_its_rank():
    """Rank 1's first parameter gets a NaN gradient once at iteration 4 (the loss is finite): the held step's
    gradients are checked, the replay's are finite, and rank 1 alone is named (its tied copy on stage 1 receives
    the NaN in the reduction, not in its own backward)."""
    _assert_exits_16_saying(4, FLAGS, "1@4:backward", (
        "iteration 4: the gradients hold a NaN or Inf (the loss passes); computed again from the same state, the "
        "gradients of pipeline stage 0 changed on rank(s) 1 (the ranks upstream of it computed on what they "
        "received): a transient fault of the device(s) of rank(s) 1."))


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev"])
def test_a_backward_fault_is_traced_under_the_schedules_that_split_the_weight_gradients(schedule):
    """ZB-H1 and DualPipeV compute the weight gradients in a phase of their own: the gradient sums see them there
    too (PP 2: rank 1 is stage 1)."""
    flags = [*COMMON, "--make-vocab-size-divisible-by", "128", "--pipeline-model-parallel-size", "2",
             "--pipeline-schedule", schedule, "--rerun-mode", "validate_results"]
    _assert_exits_16_saying(2, flags, "1@4:backward", (
        "iteration 4: the gradients hold a NaN or Inf (the loss passes); computed again from the same state, the "
        "gradients of pipeline stage 1 changed on rank(s) 1 "))


@pytest.mark.parametrize("optimizer", [["--zero-stage", "0"], ["--zero-stage", "1"], ["--zero-stage", "2"],
                                       ["--bf16"]], ids=["zero0", "zero1", "zero2", "bf16-zero1"])
def test_a_nan_gradient_is_found_where_each_optimizer_holds_it_before_the_step(optimizer):
    """DP 2 without a pipeline: the reduced gradients lie in the module (ZeRO 0), ZeRO 1/2's partitions or
    BF16_Optimizer's fp32 buffers; rank 1's NaN gradient at iteration 3 is found there before the step."""
    flags = [*COMMON, "--num-layers", "2", "--train-iters", "4", "--rerun-mode", "validate_results", *optimizer]
    _assert_exits_16_saying(2, flags, "1@3:backward", (
        "iteration 3: the gradients hold a NaN or Inf (the loss passes); computed again from the same state, the "
        "gradients of pipeline stage 0 changed on rank(s) 1 "))


def _assert_exits_16_saying(ranks, flags, corruption, message):
    """pretrain.py under tests/support/silent_corruption.py's `corruption` exits 16 with `message` in its output."""
    result = launch(ranks, flags, env=REAL_LAUNCHER, program=("-m", "tests.support.silent_corruption", corruption))
    assert result.returncode != 0 and "exitcode  : 16" in result.stdout, result.stdout[-4000:]
    assert message in result.stdout, result.stdout[-4000:]


# --- a real spike: a poisoned document --------------------------------------------------------------------

DOCUMENTS, DOCUMENT_TOKENS, ITERATIONS, POISONED_ITERATION = 1200, 16, 140, 120
SPIKE_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", str(ITERATIONS), "--lr", "1e-2", "--lr-decay-style", "constant", "--log-interval", "1",
             "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "128", "--split", "100,0,0", "--rerun-mode", "validate_results", "--check-for-spiky-loss",
             "--spiky-loss-factor", "3"]


def _corpus(folder, poisoned=None):
    """DOCUMENTS documents of DOCUMENT_TOKENS tokens (one epoch is the whole run): the pattern 1..8 again and
    again, which the model learns within a few iterations, and the document numbered `poisoned` uniformly random
    tokens. Every document has the same length, so which documents a sample holds does not depend on what they
    hold."""
    import numpy as np

    from megatron_ds.data.indexed_dataset import IndexedDatasetBuilder
    folder.mkdir(parents=True, exist_ok=True)
    pattern = np.tile(np.arange(1, 9), DOCUMENT_TOKENS // 8)
    random_tokens = np.random.default_rng(0).integers(10, 128, DOCUMENT_TOKENS)
    with IndexedDatasetBuilder(str(folder / "corpus.bin"), np.uint16) as builder:
        for number in range(DOCUMENTS):
            builder.add_document(random_tokens if number == poisoned else pattern)
        builder.finalize(str(folder / "corpus.idx"))
    return ["--data-path", str(folder / "corpus"), "--data-cache-path", str(folder / "cache")]


def _documents_by_iteration(flags):
    """{iteration: the documents of its training samples}, as the run's dataset cuts them."""
    from megatron_ds.arguments import parse_args
    from megatron_ds.data.builder import build_split_dataset, samples_per_split
    data = parse_args(flags).data
    dataset = build_split_dataset(data, "train", samples_per_split(data)["train"])
    batch = data.global_batch_size
    return {iteration: {doc for index in range((iteration - 1) * batch, iteration * batch)
                        for ids in dataset.documents_of(index).values() for doc in ids}
            for iteration in range(1, data.train_iters + 1)}


def test_a_poisoned_document_is_a_reproducible_spike_named_by_its_document(tmp_path):
    """A document of random tokens among documents of a pattern the model has learnt by then: the iteration that
    reads it spikes, the replay reproduces the spike, so does the next data-parallel replica computing it (DP 2,
    dropout on), and the run exits 17 naming the document; with --skip-spiky-batches the run drops that batch,
    says so, and finishes."""
    by_iteration = _documents_by_iteration(SPIKE_RUN + _corpus(tmp_path / "clean"))
    elsewhere = set().union(*(docs for it, docs in by_iteration.items() if it != POISONED_ITERATION))
    poisoned = min(by_iteration[POISONED_ITERATION] - elsewhere)  # a document read by that iteration alone
    flags = SPIKE_RUN + _corpus(tmp_path / "poisoned", poisoned)
    result = launch(2, flags)
    assert result.returncode != 0, result.stdout[-3000:]
    message = re.search(rf"megatron_ds: error: iteration {POISONED_ITERATION}: .*", result.stdout)
    assert message and "spike" in message.group(0), result.stdout[-3000:]
    assert ("reproduced when computed again on the same ranks (loss " in message.group(0) and "both times) and on "
            "the next data-parallel replica's devices: the data's or the model's, not a device's" in message.group(0))
    assert re.search(rf"documents \[[^\]]*\b{poisoned}\b", message.group(0)), message.group(0)
    skipped = launch(2, flags + ["--skip-spiky-batches"])
    assert_succeeded(skipped, tail=3000)
    assert sorted(losses(skipped.stdout)) == list(range(1, ITERATIONS + 1)), skipped.stdout[-3000:]
    warning = re.findall(r"WARNING: iteration (\d+): spike.*--skip-spiky-batches: skipping the batch \((.*)\)",
                         skipped.stdout)
    assert [int(iteration) for iteration, _ in warning] == [POISONED_ITERATION], warning
    assert re.search(rf"documents \[[^\]]*\b{poisoned}\b", warning[0][1]), warning


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbh1"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
     "--num-virtual-stages-per-pipeline-rank", "2"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"],
    ["--num-experts", "4", "--moe-expert-parallel-size", "2", "--expert-interval", "1"],
    ["--swiglu", "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-enable-expert-bias",
     "--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--ds-sequence-parallel-size", "2"],
    ["--context-parallel-size", "2"],
    ["--bf16"],
    ["--async-save", "--save-interval", "3"],
], ids=["zbh1", "interleaved", "dualpipev", "moe-ep2", "dropless-moe-ep2", "tp2-sp", "ulysses2", "cp2", "bf16-dp2",
        "async-save"])
def test_the_held_step_and_the_replay_are_exact_under_every_schedule_and_with_experts(layout, tmp_path):
    """Dropout on, a false alarm every 3rd iteration (correct_result): each is computed again bit for bit from the
    held state and training goes on with the losses of the run without any check (2 ranks). With --async-save the
    checkpoints are taken right after the replayed iterations."""
    def saving(run):
        return ["--save", str(tmp_path / run)] if "--async-save" in layout else []

    flags = [*COMMON, "--make-vocab-size-divisible-by", "128", *layout]
    flags[flags.index("--hidden-dropout") + 1] = flags[flags.index("--attention-dropout") + 1] = "0.1"
    plain = launch(2, flags + saving("plain"))
    checked = launch(2, flags + saving("checked") + ["--rerun-mode", "validate_results", "--error-injection-rate",
                                                     "3", "--error-injection-type", "correct_result"])
    assert_succeeded(plain, tail=3000)
    assert_succeeded(checked, tail=3000)
    assert checked.stdout.count("computed again: the same loss") == 3, checked.stdout[-3000:]
    assert losses(checked.stdout) == losses(plain.stdout) and len(losses(plain.stdout)) == 10
    if "--async-save" in layout:
        assert sorted(path.name for path in (tmp_path / "checked").glob("global_step*")) == [
            "global_step10", "global_step3", "global_step6", "global_step9"]
