"""--log-straggler (Megatron-LM's flag): which ranks compute slower than their peers.

Every rank measures, per iteration, its compute time: the iteration's wall time less the time it spent inside
torch.distributed's blocking calls (a collective or a pipeline send/receive waits there for the slowest peer,
so a straggler makes the others wait, not compute). Every log interval the ranks exchange their median and the
logging rank prints the --straggler-minmax-count slowest and fastest ranks, with host, pipeline stage and their
ratio to the median of all ranks. A rank whose time is more than --straggler-threshold x the median of its peers
(the other ranks of its pipeline stage, which run the same layers; all other ranks where the stage has no other)
for --straggler-intervals log intervals in a row (the first interval, holding the start-up's one-off costs, not
counted) is named in a warning and in TensorBoard
(straggler/rank-<r>-ratio); straggler/slowest-ratio is written every interval.

A call with async_op=True counts until it returns and again in its handle's wait(). Measured on the host's clock:
a device kernel still running when a call blocks counts as waiting.

--disable-straggler-on-startup and --straggler-ctrlr-port (Megatron-LM's flags): rank 0 listens on the port, and
each connection to it (`curl <rank 0 host>:<port>`) switches the report on or off; the ranks take rank 0's word at
the next log interval (the report's exchange carries it, so a switched-off detector still exchanges once per
interval). Where the port cannot be had, a warning says so and the detector stays as it started.
"""
import functools
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

_BLOCKING_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                   "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "send",
                   "recv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object")


class CommunicationClock:
    """Seconds this process has spent inside torch.distributed's blocking calls (outermost calls only: an
    object collective runs tensor collectives inside)."""

    def __init__(self):
        self.seconds = 0.0
        self._depth = 0

    def install(self):
        for name in _BLOCKING_CALLS:
            function = getattr(dist, name, None)
            if function is not None and not getattr(function, "timed_by_clock", False):
                setattr(dist, name, self._timed(function))
        return self

    def _timed(self, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            result = self.measured(function, *args, **kwargs)
            return _TimedWork(result, self) if kwargs.get("async_op") and result is not None else result
        timed.timed_by_clock = True
        return timed

    def measured(self, function, *args, **kwargs):
        self._depth += 1
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            self._depth -= 1
            if not self._depth:
                self.seconds += time.perf_counter() - start


class _TimedWork:
    """An async call's handle whose wait() the clock counts (DeepSpeed's ZeRO reductions wait this way)."""

    def __init__(self, work, clock):
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        return self._clock.measured(self._work.wait, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@dataclass(frozen=True)
class RankTime:
    rank: int
    host: str
    stage: int
    seconds: float   # compute per iteration, the interval's median


def peer_ratios(times):
    """{rank: its time / the median of its peers' (the other ranks of its stage, else all other ranks)}."""
    ratios = {}
    for mine in times:
        peers = [other.seconds for other in times if other.rank != mine.rank and other.stage == mine.stage]
        peers = peers or [other.seconds for other in times if other.rank != mine.rank]
        ratios[mine.rank] = mine.seconds / statistics.median(peers) if peers else 1.0
    return ratios


def extremes_line(times, count, first, last):
    """The slowest and fastest `count` ranks against the median of all."""
    median = statistics.median(entry.seconds for entry in times)
    slowest = sorted(times, key=lambda entry: (-entry.seconds, entry.rank))
    fastest = sorted(times, key=lambda entry: (entry.seconds, entry.rank))

    def described(selection):
        return ", ".join(f"rank {entry.rank} ({entry.host}, stage {entry.stage}) {entry.seconds * 1e3:.1f} ms "
                         f"{entry.seconds / median:.2f}x" for entry in selection)
    return (f"straggler check, iterations {first}-{last}: compute per iteration, median {median * 1e3:.1f} ms; "
            f"slowest {described(slowest[:count])}; fastest {described(fastest[:count])}")


class SwitchServer:
    """On rank 0: every connection to `port` flips `wanted` and is answered with the new state (an HTTP reply, for
    curl)."""

    def __init__(self, port, wanted):
        self.wanted = wanted
        self.listener = socket.create_server(("", port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            connection, _ = self.listener.accept()
            with connection:
                connection.settimeout(1.0)
                try:
                    connection.recv(4096)  # the request, if any: every connection flips
                except OSError:
                    pass
                self.wanted = not self.wanted
                body = f"straggler detector {'on' if self.wanted else 'off'} from the next log interval\n"
                connection.sendall(f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}"
                                   f"\r\n\r\n{body}".encode())


def switch_server(port, wanted):
    """The SwitchServer on rank 0 (None elsewhere, or with a warning where the port cannot be had)."""
    if dist.get_rank() != 0:
        return None
    try:
        return SwitchServer(port, wanted)
    except OSError as error:
        print(f"megatron_ds: WARNING: --straggler-ctrlr-port {port}: cannot listen ({error}); the straggler "
              f"detector stays {'on' if wanted else 'off'}", flush=True)
        return None


class StragglerDetector:
    """Every rank: begin() and end() around each training iteration, report() at each log interval (a
    collective). The logging rank prints; every rank keeps the same counts. enabled: whether it reports from the
    start; switch_port: the port rank 0 listens on for switching it (None: no switch)."""

    def __init__(self, threshold, minmax_count, intervals, stage, clock=None, enabled=True, switch_port=None):
        self.threshold, self.minmax_count, self.intervals = threshold, minmax_count, intervals
        self.stage, self.host = stage, socket.gethostname()
        self.clock = clock or CommunicationClock().install()
        self.enabled, self.switch_port = enabled, switch_port
        self.switch = switch_server(switch_port, enabled) if switch_port else None
        self.consecutive = {}   # rank: log intervals in a row above the threshold
        self._reset(first=1)

    def _reset(self, first):
        self.computed, self.first = [], first

    def begin(self):
        self._start, self._waited = time.perf_counter(), self.clock.seconds

    def end(self):
        self.computed.append((time.perf_counter() - self._start) - (self.clock.seconds - self._waited))

    def report(self, iteration, printing, writers=None):
        """Exchange the interval's times (each rank's median iteration: a one-off pause is not a straggler); the
        lines to print (on the printing rank) and the scalars written. The first interval, which holds the
        start-up's one-off costs, warns no one."""
        mine = RankTime(dist.get_rank(), self.host, self.stage, statistics.median(self.computed or [0.0]))
        exchanged = [None] * dist.get_world_size()
        dist.all_gather_object(exchanged, (mine, self.switch.wanted if self.switch else None))
        everyone, wanted = [entry for entry, _ in exchanged], exchanged[0][1]
        if wanted is not None and wanted != self.enabled:
            return self._switched(wanted, iteration, printing)
        if not self.enabled:
            self._reset(first=iteration + 1)
            return []
        lines = [extremes_line(everyone, self.minmax_count, self.first, iteration)]
        ratios = peer_ratios(everyone)
        scalars = {"straggler/slowest-ratio": max(ratios.values())}
        warming_up = self.first == 1
        for entry in everyone:
            slow = ratios[entry.rank] > self.threshold and not warming_up
            self.consecutive[entry.rank] = self.consecutive.get(entry.rank, 0) + 1 if slow else 0
            if self.consecutive[entry.rank] >= self.intervals:
                lines.append(f"WARNING: straggler: rank {entry.rank} ({entry.host}, stage {entry.stage}) computed "
                             f"{ratios[entry.rank]:.2f}x the median of its peers for {self.consecutive[entry.rank]} "
                             f"log intervals in a row (--straggler-threshold {self.threshold:g})")
                scalars[f"straggler/rank-{entry.rank}-ratio"] = ratios[entry.rank]
        if printing:
            for line in lines:
                print(f"megatron_ds: {line}", flush=True)
            if writers is not None:
                writers.write(scalars, iteration)
        self._reset(first=iteration + 1)
        return lines

    def _switched(self, wanted, iteration, printing):
        """Switched on or off through --straggler-ctrlr-port: counts start afresh from the next iteration."""
        self.enabled, self.consecutive = wanted, {}
        line = (f"straggler detector switched {'on' if wanted else 'off'} at iteration {iteration} "
                f"(--straggler-ctrlr-port {self.switch_port})")
        if printing:
            print(f"megatron_ds: {line}", flush=True)
        self._reset(first=iteration + 1)
        return [line]
