"""The replay that tells whether the pipeline's messages arrive under NCCL as they do under gloo
(tests/support/p2p_recorder.py: the senders' sends and the receivers' receives replayed first in first out without
tags, as NCCL pairs them; why, and the real pipeline runs it checks: tests/e2e/test_pipeline_message_order.py)
catches a reorder: on hand-made streams, and on two real gloo ranks whose batch posts two tags in the other order
than the receiver's (gloo delivers them right)."""
import json
from pathlib import Path

from megatron_ds.core.deepspeed_internals.interleaved_pipeline import ACTIVATION_TAG, GRADIENT_TAG
from tests.support.p2p_recorder import load, payload_mismatches, untagged_fifo_mispairings

ACTIVATION, GRADIENT = ACTIVATION_TAG, GRADIENT_TAG


def _message(seq, side, rank, peer, tag, shape=(2, 32, 64), dtype="torch.float32", batch=0, digest=None):
    return {"seq": seq, "side": side, "rank": rank, "peer": peer, "group": "0", "tag": tag, "shape": list(shape),
            "dtype": dtype, "batch": batch, "blocking": False, "done": seq, "digest": digest or f"{tag}-{seq}"}


def _ping_pong(sender_tags, receiver_tags):
    """Rank 0 sends messages of sender_tags to rank 1 in one batch, rank 1 receives receiver_tags from rank 0 in
    one batch (same shapes: the interleaved engine's activations and gradients at PP 2); payloads as gloo, by tag,
    delivered them."""
    sends = [_message(i, "send", 0, 1, tag, digest=f"payload{i}") for i, tag in enumerate(sender_tags)]
    by_tag = {}
    for send in sends:
        by_tag.setdefault(send["tag"], []).append(send["digest"])
    recvs = [_message(i, "recv", 1, 0, tag, digest=by_tag[tag].pop(0)) for i, tag in enumerate(receiver_tags)]
    return {0: sends, 1: recvs}


def test_the_replay_accepts_streams_posted_in_the_same_order():
    streams = _ping_pong([ACTIVATION, GRADIENT, ACTIVATION], [ACTIVATION, GRADIENT, ACTIVATION])
    assert untagged_fifo_mispairings(streams) == [] and payload_mismatches(streams) == []


def test_the_replay_catches_two_messages_of_different_tags_swapped():
    """gloo delivers these by tag, right; NCCL would hand the receive of the activation the gradient."""
    streams = _ping_pong([GRADIENT, ACTIVATION, ACTIVATION], [ACTIVATION, GRADIENT, ACTIVATION])
    problems = untagged_fifo_mispairings(streams)
    assert [(p.sender, p.receiver, p.index, p.send["tag"], p.recv["tag"]) for p in problems] == [
        (0, 1, 0, GRADIENT, ACTIVATION), (0, 1, 1, ACTIVATION, GRADIENT)]
    assert "rank 0 -> rank 1 (group 0), message 0: send #0 on rank 0 (batch 0): tag 2" in str(problems[0])
    assert [p.index for p in payload_mismatches(streams)] == [0, 1]  # what each got is not what NCCL gives it


def test_the_replay_catches_another_shape_or_dtype_and_a_missing_message():
    streams = _ping_pong([ACTIVATION, ACTIVATION], [ACTIVATION, ACTIVATION])
    streams[0][1]["shape"] = [2, 16, 64]
    assert [p.index for p in untagged_fifo_mispairings(streams)] == [1]
    streams[0][1]["shape"], streams[0][1]["dtype"] = [2, 32, 64], "torch.bfloat16"
    assert [p.index for p in untagged_fifo_mispairings(streams)] == [1]
    streams[0][1]["dtype"] = "torch.float32"
    streams[1].append(_message(2, "recv", 1, 0, ACTIVATION))
    [missing] = untagged_fifo_mispairings(streams)
    assert missing.index == 2 and missing.send is None and "nothing would be delivered" in str(missing)


def test_the_replay_catches_a_batched_send_received_alone():
    """A single send or recv goes on the pair's own NCCL communicator, a batch on the group's."""
    streams = _ping_pong([0, ACTIVATION], [0, ACTIVATION])
    streams[1][0]["batch"] = None
    [problem] = untagged_fifo_mispairings(streams)
    assert problem.index == 0 and "(single): tag 0" in str(problem)


def test_the_replay_keeps_each_direction_and_pair_apart():
    """Rank 0's gradient to rank 1 and rank 1's activation to rank 0 are different queues, as is rank 2's."""
    streams = {0: [_message(0, "send", 0, 1, GRADIENT), _message(1, "recv", 0, 1, ACTIVATION),
                   _message(2, "recv", 0, 2, GRADIENT)],
               1: [_message(0, "send", 1, 0, ACTIVATION), _message(1, "recv", 1, 0, GRADIENT)],
               2: [_message(0, "send", 2, 0, GRADIENT)]}
    for rank, peer, seq in ((1, 0, 1), (0, 1, 0), (0, 2, 0)):  # align the payloads of each pair
        recv = next(m for m in streams[rank] if m["side"] == "recv" and m["peer"] == peer)
        recv["digest"] = next(m for m in streams[peer] if m["side"] == "send" and m["peer"] == rank)["digest"]
    assert untagged_fifo_mispairings(streams) == [] and payload_mismatches(streams) == []


def _swapped_batch(folder):
    """On each of two gloo ranks (tests/support/distributed.py): the recorder installed, then one batch - rank 0 posts a
    gradient-tagged send and then an activation-tagged one, rank 1 receives the activation first - and the
    rank's record written to folder."""
    import torch
    import torch.distributed as dist

    from tests.support.p2p_recorder import Recorder
    recorder = Recorder().install()
    rank = dist.get_rank()
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.full((4,), 2.0), 1, tag=GRADIENT),
               dist.P2POp(dist.isend, torch.full((4,), 1.0), 1, tag=ACTIVATION)]
    else:
        received = {ACTIVATION: torch.zeros(4), GRADIENT: torch.zeros(4)}
        ops = [dist.P2POp(dist.irecv, received[ACTIVATION], 0, tag=ACTIVATION),
               dist.P2POp(dist.irecv, received[GRADIENT], 0, tag=GRADIENT)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if rank == 1:  # gloo matched them by tag
        assert received[ACTIVATION].tolist() == [1.0] * 4 and received[GRADIENT].tolist() == [2.0] * 4
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "messages": recorder.messages}))


def test_the_recorder_catches_a_reorder_that_gloo_hides(tmp_path):
    from tests.support.distributed import run_distributed
    run_distributed(_swapped_batch, 2, str(tmp_path), timeout=60)
    records = load(tmp_path)
    assert [(m["side"], m["peer"], m["tag"], m["batch"], m["done"] is not None) for m in records[0]] == [
        ("send", 1, GRADIENT, 0, True), ("send", 1, ACTIVATION, 0, True)]
    assert [(m["side"], m["peer"], m["tag"]) for m in records[1]] == [("recv", 0, ACTIVATION), ("recv", 0, GRADIENT)]
    problems = untagged_fifo_mispairings(records)
    assert [(p.index, p.send["tag"], p.recv["tag"]) for p in problems] == [(0, GRADIENT, ACTIVATION),
                                                                          (1, ACTIVATION, GRADIENT)]
    assert len(payload_mismatches(records)) == 2
