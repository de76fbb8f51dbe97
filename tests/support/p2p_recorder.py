"""Every point-to-point message a rank posts and completes, recorded at torch.distributed's level, and the check
that NCCL - which ignores tags and hands a receiver a sender's messages first in, first out - would pair them as
gloo (which matches by tag) paired them.

The recorder wraps torch.distributed's isend and irecv (in torch.distributed and in distributed_c10d, where
send, recv, batch_isend_irecv and P2POp's check look them up), and its send, recv and batch_isend_irecv to say
how each message was posted: DeepSpeed's blocking p2p (1F1B, ZB-H1 and every engine's tensor-meta exchange: send
and recv), its DualPipeV commits and the interleaved engine's (batch_isend_irecv of DeepSpeed's P2POps, which
DeepSpeed turns into torch's). Per message: the posting order on the rank, send or recv, the peer (global rank),
the process group, the tag, shape and dtype, the batch (the rank's n-th batch_isend_irecv, None for a single
call), when it completed (the rank's completion order) and a digest of its payload (a send's when posted, a
receive's when complete).

    python -m tests.support.p2p_recorder    # tests/support/zygote.py's request loop with the recorder installed:
                                            # every rank of a launch writes $P2P_RECORD_DIR/rank<R>.json at its exit
                                            # ($P2P_SWAP_RECEIVES: install_receive_swap's fault)
"""
import atexit
import functools
import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

RECORD_DIR = "P2P_RECORD_DIR"
SWAP_RECEIVES = "P2P_SWAP_RECEIVES"


def _digest(tensor):
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


class _Completion:
    """A Work whose wait() records its message's completion (everything else is the Work's)."""

    def __init__(self, work, done):
        self._work, self._done = work, done

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._done()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class Recorder:
    def __init__(self):
        self.messages = []
        self._completed = 0
        self._batches = 0
        self._batch = None      # the index of the batch_isend_irecv being posted
        self._blocking = False  # inside send or recv

    def install(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv")}
        wrapped = {"isend": self._posting("send", originals["isend"]),
                   "irecv": self._posting("recv", originals["irecv"]),
                   "send": self._blocking_call(originals["send"]), "recv": self._blocking_call(originals["recv"]),
                   "batch_isend_irecv": self._batched(originals["batch_isend_irecv"])}
        for name, function in wrapped.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
        atexit.register(self.dump)
        return self

    def _posting(self, side, original):
        from torch.distributed import distributed_c10d as c10d
        signature = inspect.signature(original)
        peer_name = "dst" if side == "send" else "src"

        @functools.wraps(original)
        def post(*args, **kwargs):
            work = original(*args, **kwargs)
            arguments = signature.bind(*args, **kwargs).arguments
            tensor, tag = arguments["tensor"], arguments.get("tag", 0)
            group = arguments.get("group") or c10d._get_default_group()
            peer = arguments.get(peer_name)
            if peer is None and arguments.get(f"group_{peer_name}") is not None:
                peer = c10d.get_global_rank(group, arguments[f"group_{peer_name}"])
            message = {"seq": len(self.messages), "side": side, "rank": c10d.get_rank(), "peer": peer,
                       "group": group.group_name, "tag": tag, "shape": list(tensor.shape), "dtype": str(tensor.dtype),
                       "batch": self._batch, "blocking": self._blocking, "done": None,
                       "digest": _digest(tensor) if side == "send" else None}
            self.messages.append(message)

            def done():
                if message["done"] is None:
                    message["done"] = self._completed
                    self._completed += 1
                    if side == "recv":
                        message["digest"] = _digest(tensor)
            return None if work is None else _Completion(work, done)
        return post

    def _blocking_call(self, original):
        @functools.wraps(original)
        def blocking(*args, **kwargs):
            self._blocking = True
            try:
                return original(*args, **kwargs)
            finally:
                self._blocking = False
        return blocking

    def _batched(self, original):
        @functools.wraps(original)
        def batched(p2p_op_list):
            self._batch, self._batches = self._batches, self._batches + 1
            try:
                return original(p2p_op_list)
            finally:
                self._batch = None
        return batched

    def dump(self):
        folder = os.environ.get(RECORD_DIR)
        if folder and self.messages:
            rank = self.messages[0]["rank"]
            Path(folder, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "messages": self.messages}))


def load(folder):
    """{rank: [message, ...]} as the ranks of a launch wrote them."""
    return {int(path.stem[4:]): json.loads(path.read_text())["messages"] for path in Path(folder).glob("rank*.json")}


# --- the replay -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mispairing:
    sender: int
    receiver: int
    group: str
    index: int       # the index of the message in the pair's first-in-first-out order
    send: dict       # None where the sender posted fewer
    recv: dict       # None where the receiver posted fewer

    def __str__(self):
        def show(message):
            if message is None:
                return "nothing"
            batch = "single" if message["batch"] is None else f"batch {message['batch']}"
            return (f"{message['side']} #{message['seq']} on rank {message['rank']} ({batch}): tag {message['tag']}, "
                    f"{message['dtype']} {message['shape']}")
        return (f"rank {self.sender} -> rank {self.receiver} (group {self.group}), message {self.index}: "
                f"{show(self.send)} would be delivered to {show(self.recv)}")


def pair_streams(messages_by_rank):
    """{(sender, receiver, group): (the sender's sends to the receiver, the receiver's receives from the sender)},
    each in its rank's posting order."""
    streams = {}
    for rank, messages in messages_by_rank.items():
        for message in sorted(messages, key=lambda m: m["seq"]):
            if message["side"] == "send":
                key = (rank, message["peer"], message["group"])
            else:
                key = (message["peer"], rank, message["group"])
            streams.setdefault(key, ([], []))[0 if message["side"] == "send" else 1].append(message)
    return streams


def _kind(message):
    """What a receive must match in its send: the tag (which gloo matched by), shape and dtype, and whether it was
    batched (torch's ProcessGroupNCCL posts a single send or recv on a communicator of the pair's own, a batch's on
    the group's: the two are separate queues, both first in first out)."""
    return message["tag"], message["shape"], message["dtype"], message["batch"] is not None


def untagged_fifo_mispairings(messages_by_rank):
    """NCCL's delivery: per (sender, receiver) pair, the n-th receive gets the n-th send, tags ignored. Every pair
    where that hands a receive a send of another tag, shape or dtype, or one batched where the other is single
    (what gloo, matching by tag, did not do), or where the counts differ. (A pair whose messages all match so in
    one queue also match in the two queues of NCCL's two communicators.)"""
    problems = []
    for (sender, receiver, group), (sends, recvs) in sorted(pair_streams(messages_by_rank).items()):
        for index in range(max(len(sends), len(recvs))):
            send = sends[index] if index < len(sends) else None
            recv = recvs[index] if index < len(recvs) else None
            if send is None or recv is None or _kind(send) != _kind(recv):
                problems.append(Mispairing(sender, receiver, group, index, send, recv))
    return problems


def payload_mismatches(messages_by_rank):
    """The receives whose payload (what gloo delivered) is not the payload of the send that the untagged
    first-in-first-out order pairs them with (what NCCL would deliver), and every message never completed."""
    problems = []
    for (sender, receiver, group), (sends, recvs) in sorted(pair_streams(messages_by_rank).items()):
        for index, (send, recv) in enumerate(zip(sends, recvs)):
            if send["done"] is None or recv["done"] is None or send["digest"] != recv["digest"]:
                problems.append(Mispairing(sender, receiver, group, index, send, recv))
    return problems


def install_receive_swap():
    """A fault for the tests to inject: where $P2P_SWAP_RECEIVES names the rank's pipeline stage, its interleaved
    schedule queues each step's receives in the reverse order (the gradient's before the next forward's input).
    Each receive still gets its tag and buffer, so gloo trains exactly the same; NCCL would not."""
    from megatron_ds.core.deepspeed_internals.interleaved_pipeline import InterleavedSchedule
    original = InterleavedSchedule._receives

    @functools.wraps(original)
    def receives(self, slot):
        commands = original(self, slot)
        return commands[::-1] if os.environ.get(SWAP_RECEIVES) == str(self.stage_id) else commands
    InterleavedSchedule._receives = receives


def main():
    from tests.support import zygote
    zygote._import_once()
    Recorder().install()
    install_receive_swap()
    zygote.serve()


if __name__ == "__main__":
    main()
