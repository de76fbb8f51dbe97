"""The pipeline's messages arrive under NCCL as they do under gloo. Activations and gradients between two pipeline
ranks travel under their own tags in the interleaved engine (at PP 2 both kinds go both ways between the same
pair, with the same shapes); gloo matches a receive to a send by tag, NCCL ignores tags and hands a receiver a
sender's messages first in, first out. So every test on gloo would pass with the messages posted in an order that
NCCL pairs wrongly. Here real pipeline training runs on gloo CPU ranks with every point-to-point message recorded
(tests/support/p2p_recorder.py: torch.distributed's isend and irecv, under DeepSpeed's blocking send/recv and its
batched commits alike), and for every (sender, receiver) pair the sender's sends and the receiver's receives, replayed
first in first out without tags, must pair each receive with a send of its tag, shape and dtype, both batched or
both single (NCCL's two communicators) - and with the very payload gloo delivered to it; and every activation and
gradient the schedule sends must have been recorded. Under the interleaved schedule (2 and 3 chunks per rank, PP 2
and 4, with a sequence-length curriculum that changes the shapes mid-run and re-exchanges them), DualPipeV, 1F1B
and ZB-H1, each for two training iterations and an evaluation (about 20 s in all on 2 cores). The replay catches a
reorder in the interleaved engine itself with one rank's receives queued in reverse (it trains bitwise the same on
gloo); on hand-made streams and two gloo ranks: tests/unit/engine/test_pipeline_message_order.py."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_ds.core.deepspeed_internals.interleaved_pipeline import ACTIVATION_TAG, GRADIENT_TAG
from megatron_ds.core.pipeline_schedules import pipeline_messages_per_micro_batch
from tests.support.launch import REPO, clean_env, losses, request_launch
from tests.support.layouts import COMMON, SCHEDULE_FLAGS
from tests.support.p2p_recorder import RECORD_DIR, SWAP_RECEIVES, load, payload_mismatches, untagged_fifo_mispairings

ACTIVATION, GRADIENT = ACTIVATION_TAG, GRADIENT_TAG
META = 0  # DeepSpeed's own tag: its tensor-meta exchange, and every message of the other schedules


def _flags(**overrides):
    flags = list(COMMON)
    for name, value in {"--train-iters": "2", "--eval-interval": "2", **overrides}.items():
        if name in flags:
            flags[flags.index(name) + 1] = value
        else:
            flags += [name, value]
    return flags + ["--eval-iters", "1"]


PP2 = ["--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256"]
PP4 = ["--pipeline-model-parallel-size", "4", "--make-vocab-size-divisible-by", "256"]
CURRICULUM = {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                      "max_difficulty": 32, "schedule_type": "fixed_linear",
                                      "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 8}}}
CASES = {  # name: (ranks, pretrain.py flags, a DeepSpeed config to pass with --deepspeed_config, or None)
    "interleaved-pp2": (2, _flags() + PP2 + SCHEDULE_FLAGS["interleaved"], None),
    "interleaved-pp2-v3": (2, _flags(**{"--num-layers": "6"}) + PP2 + ["--num-virtual-stages-per-pipeline-rank",
                                                                       "3"], None),
    "interleaved-pp2-curriculum": (2, _flags(**{"--train-iters": "3"}) + PP2 + SCHEDULE_FLAGS["interleaved"],
                                   CURRICULUM),
    # 8 model stages, and DualPipeVEngine's 2 x PP micro-batches
    "interleaved-pp4": (4, _flags(**{"--num-layers": "8", "--global-batch-size": "16"}) + PP4 +
                        SCHEDULE_FLAGS["interleaved"], None),
    "dualpipev-pp2": (2, _flags() + PP2 + SCHEDULE_FLAGS["dualpipev"], None),
    "dualpipev-pp4": (4, _flags(**{"--num-layers": "8", "--global-batch-size": "16"}) + PP4 +
                      SCHEDULE_FLAGS["dualpipev"], None),
    "1f1b-pp2": (2, _flags() + PP2 + SCHEDULE_FLAGS["1f1b"], None),
    "zbh1-pp4": (4, _flags() + PP4 + SCHEDULE_FLAGS["zbh1"], None),
}
_server, _records, _folders = [], {}, []


def _recording_launcher():
    """tests/support/p2p_recorder.py's request loop (tests/support/zygote.py's, the recorder installed), started
    once."""
    if not _server or _server[0].poll() is not None:
        _server[:] = [subprocess.Popen([sys.executable, "-m", "tests.support.p2p_recorder"], cwd=REPO, text=True,
                                       env=clean_env(PYTHONUNBUFFERED="1"), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE)]
    return _server[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_the_recording_launcher():
    yield
    if _server and _server[0].poll() is None:
        _server[0].stdin.close()
        _server[0].wait(timeout=30)
    for folder in _folders:
        shutil.rmtree(folder, ignore_errors=True)


def _recorded(case, swapped_receives_on=None):
    """{rank: messages} of the case's launch (memoized), with its output and seconds; swapped_receives_on: the
    pipeline rank whose receives tests/support/p2p_recorder.py's install_receive_swap reverses."""
    key = (case, swapped_receives_on)
    if key not in _records:
        ranks, flags, ds_config = CASES[case]
        folder = Path(tempfile.mkdtemp(prefix=f"megatron_ds_p2p_{case}_"))
        _folders.append(folder)
        if ds_config is not None:
            (folder / "ds.json").write_text(json.dumps(ds_config))
            flags = flags + ["--deepspeed_config", str(folder / "ds.json")]
        launcher = _recording_launcher()
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", RECORD_DIR: str(folder)}
        if swapped_receives_on is not None:
            environment[SWAP_RECEIVES] = str(swapped_receives_on)
        started = time.monotonic()
        answer, output = request_launch(launcher, ranks, ("pretrain.py",), flags, environment, timeout=120)
        assert answer == {"returncode": 0, "timed_out": False}, output[-6000:]
        assert "validation loss at iteration 2" in output, output[-4000:]
        _records[key] = load(folder), output, time.monotonic() - started
    return _records[key]


def _flag(flags, name):
    return int(flags[len(flags) - 1 - flags[::-1].index(name) + 1])


def _expected_counts(case):
    """Per rank {(side, tag or None): messages}: what the schedule posts per micro-batch
    (core/pipeline_schedules.py's pipeline_messages_per_micro_batch) over the training iterations' micro-batches,
    the activations over the evaluation's too; by tag under the interleaved schedule, all together (None) under
    DeepSpeed's untagged ones."""
    ranks, flags, _ = CASES[case]
    schedule = case.split("-")[0]
    virtual = _flag(flags, "--num-virtual-stages-per-pipeline-rank") if schedule == "interleaved" else 1
    micro_batches = _flag(flags, "--global-batch-size") // _flag(flags, "--micro-batch-size")
    trained, evaluated = _flag(flags, "--train-iters") * micro_batches, _flag(flags, "--eval-iters") * micro_batches
    expected = {}
    for rank in range(ranks):
        per = pipeline_messages_per_micro_batch(schedule, ranks, rank, virtual)
        counts = {("send", ACTIVATION): per["send_activation"] * (trained + evaluated),
                  ("send", GRADIENT): per["send_gradient"] * trained,
                  ("recv", ACTIVATION): per["receive_activation"] * (trained + evaluated),
                  ("recv", GRADIENT): per["receive_gradient"] * trained}
        if schedule != "interleaved":
            counts = {(side, None): counts[side, ACTIVATION] + counts[side, GRADIENT] for side in ("send", "recv")}
        expected[rank] = counts
    return expected


def _observed_counts(case, records):
    """Per rank {(side, tag or None): messages} of the activations and gradients recorded (3-d floating-point
    tensors: not the tensor-meta exchange's integers nor the engine's 0-d warm-up of its p2p)."""
    tagged = case.startswith("interleaved")
    observed = {}
    for rank, messages in records.items():
        counts = observed.setdefault(rank, {})
        for message in messages:
            if len(message["shape"]) == 3 and message["dtype"] == "torch.float32":
                key = (message["side"], message["tag"] if tagged else None)
                counts[key] = counts.get(key, 0) + 1
    return {rank: {key: count for key, count in counts.items()} for rank, counts in observed.items()}


def _summary(records):
    """Per rank: {(side, peer, tag): count}."""
    counts = {}
    for rank, messages in records.items():
        for message in messages:
            key = (rank, message["side"], message["peer"], message["tag"])
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_nccls_first_in_first_out_delivers_what_gloo_delivered_by_tag(case):
    records, output, seconds = _recorded(case)
    ranks = CASES[case][0]
    assert sorted(records) == list(range(ranks)), output[-4000:]
    problems = untagged_fifo_mispairings(records)
    assert problems == [], "\n".join(map(str, problems[:20]))
    problems = payload_mismatches(records)
    assert problems == [], "\n".join(map(str, problems[:20]))
    expected = {rank: {key: count for key, count in counts.items() if count} for rank, counts in
                _expected_counts(case).items()}
    assert _observed_counts(case, records) == expected  # every message the schedule posts was recorded
    messages = [message for rank in records for message in records[rank]]
    tags = {message["tag"] for message in messages}
    if case.startswith("interleaved"):
        assert tags == {META, ACTIVATION, GRADIENT}, tags  # the replay had tags to confuse
        assert all(message["batch"] is not None for message in messages if message["tag"] != META)
        if ranks == 2:  # both kinds both ways between the one pair
            summary = _summary(records)
            assert all(summary.get((rank, "send", 1 - rank, tag), 0) > 0 for rank in (0, 1)
                       for tag in (ACTIVATION, GRADIENT)), summary
    else:
        assert tags == {0}, tags  # DeepSpeed's own p2p: untagged, so gloo is first in first out too
    if "curriculum" in case:  # the sequence length grew: new shapes, exchanged again mid-run
        assert len({tuple(m["shape"]) for m in messages if len(m["shape"]) == 3}) == 2
    sends = sum(message["side"] == "send" for message in messages)
    print(f"{case}: {sends} messages in {seconds:.1f} s: {_summary(records)}")


def test_a_reorder_in_the_interleaved_engine_fails_the_replay_though_gloo_trains_the_same():
    """Rank 1 queuing each step's receives in reverse (the gradient before the next forward's input): gloo, by
    tag, trains bitwise the same, while NCCL's first in first out would hand rank 1 an activation for a gradient."""
    records, output, _ = _recorded("interleaved-pp2", swapped_receives_on=1)
    assert losses(output) == losses(_recorded("interleaved-pp2")[1]) != {}
    assert payload_mismatches(records) != []
    problems = untagged_fifo_mispairings(records)
    assert problems and {(p.sender, p.receiver) for p in problems} == {(0, 1)}, "\n".join(map(str, problems))
    assert {(p.send["tag"], p.recv["tag"]) for p in problems} == {(ACTIVATION, GRADIENT), (GRADIENT, ACTIVATION)}
    print(f"{len(problems)} mispairings, the first: {problems[0]}")
