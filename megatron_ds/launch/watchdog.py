"""Hang safety: a rank that raises, dies or hangs makes every rank exit within a bounded time, with a message
naming the failed rank, its host and what it was doing, instead of waiting in a collective (NCCL waits forever).

Every rank runs a daemon thread that talks to the rendezvous store (a second client of the TCPStore at
MASTER_ADDR:MASTER_PORT, so it works while the main thread sits in a collective):
- it publishes a heartbeat: a counter, its host, pid and current activity;
- it watches one neighbour's heartbeat (rank + 1, a ring: O(1) store traffic per rank); a neighbour
  silent for `silence_limit` seconds is declared hung in a shared failure notice. A neighbour on the same
  machine is also watched by pid, so its death is reported at once: the deepspeed launcher tears the job
  down about a second after a rank dies, long before any silence limit, and names the wrong rank;
- it polls the failure notice; once set, it prints it and ends the process with status 1.
A rank that raises posts the notice itself before exiting. Losing the store (its host died) also ends
the process.

The store may live inside rank 0 (deepspeed launcher, mpirun): a stopped rank 0 (kill -STOP) freezes it, and
a TCPStore client then waits for a reply forever, whatever its timeout. So store calls run on a helper
thread and are waited for at most `silence_limit` seconds: no reply in that time declares the store's host hung.

MEGATRON_DS_HEARTBEAT_TIMEOUT (seconds, default 30) sets the silence limit.
"""
import concurrent.futures
import datetime
import os
import queue
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass

import psutil
import torch.distributed as dist

from megatron_ds.launch.launcher_env import store_hosted_by_launcher

_KEYS = "megatron_ds/watchdog"
_DONE = "done"
SILENCE_LIMIT_VARIABLE = "MEGATRON_DS_HEARTBEAT_TIMEOUT"
DEFAULT_SILENCE_LIMIT = 30.0
_PROCESS_POLL = 0.1  # seconds between looks at a same-machine neighbour's process where pidfd_open is missing


class StoreUnresponsive(Exception):
    """A rendezvous store call got no reply within the limit: the process hosting the store is hung or stopped."""


class _BoundedStore:
    """Store calls run one at a time on a daemon thread; a caller waits for each at most `limit` seconds
    (a TCPStore client has no reply timeout: `check`, `get` and `compare_set` on a frozen server never return).
    After a timeout the thread stays stuck, so every later call times out too."""

    def __init__(self, store, limit):
        self._store, self.limit = store, limit
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="megatron_ds-watchdog-store", daemon=True).start()

    def post(self, call):
        """Queue call(store) without waiting; returns its Future."""
        future = concurrent.futures.Future()
        self._calls.put((call, future))
        return future

    def run(self, call):
        """call(store)'s result; StoreUnresponsive when it has not returned within the limit."""
        try:
            return self.post(call).result(timeout=self.limit)
        except concurrent.futures.TimeoutError:
            raise StoreUnresponsive(f"no reply for {self.limit:.0f} s") from None

    def value(self, key):
        """The value at key, or None when it is not set (a plain `get` would wait for it)."""
        return self.run(lambda store: store.get(key).decode() if store.check([key]) else None)

    def compare_set(self, key, expected, desired):
        return self.run(lambda store: store.compare_set(key, expected, desired).decode())

    def _serve(self):
        while True:
            call, future = self._calls.get()
            try:
                future.set_result(call(self._store))
            except Exception as error:
                future.set_exception(error)


def _machine_id():
    """Equal for two processes exactly when each can look the other up by pid: same kernel, same pid namespace
    (containers on one host may share a host name, not a pid namespace). Empty where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            return f"{boot_id.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


_HOST = socket.gethostname()
_MACHINE = _machine_id()


@dataclass(frozen=True)
class _Heartbeat:
    count: int
    host: str
    pid: int
    machine: str
    activity: str

    def text(self):
        return f"{self.count}|{self.host}|{self.pid}|{self.machine}|{self.activity}"

    @classmethod
    def parse(cls, text):
        count, host, pid, machine, activity = text.split("|", 4)
        return cls(int(count), host, int(pid), machine, activity)


class _Neighbour:
    """The rank this one watches: its last heartbeat and when that last changed; when it runs on this machine,
    also its process, so that a death is seen at once."""

    def __init__(self, rank):
        self.rank = rank
        self.finished = False
        self.heartbeat = None
        self.changed_at = time.monotonic()
        self._text = None
        self._process = None
        self._exit_fd = None  # readable once its process has ended (Linux pidfd)

    def saw(self, text):
        """Record the neighbour's heartbeat text (None: none yet)."""
        if text == _DONE:
            self.finished = True
        elif text != self._text:
            self._text, self.changed_at = text, time.monotonic()
            self.heartbeat = _Heartbeat.parse(text) if text else None
            if self._process is None and self.heartbeat and _MACHINE and self.heartbeat.machine == _MACHINE:
                self._process, self._exit_fd = _process(self.heartbeat.pid), _exit_fd(self.heartbeat.pid)

    def silent_for(self):
        return time.monotonic() - self.changed_at

    def died_within(self, seconds):
        """Wait up to seconds; True as soon as its process ends (known only for a process on this machine). The
        deepspeed launcher ends the job within a second of a death: this rank must name the dead one first."""
        if self._exit_fd is not None:
            return bool(select.select([self._exit_fd], [], [], seconds)[0])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._process is not None and self._process_state() in ("gone", psutil.STATUS_ZOMBIE):
                return True
            time.sleep(_PROCESS_POLL if self._process is not None else seconds)
        return False

    @property
    def activity(self):
        return self.heartbeat.activity if self.heartbeat else "start-up"

    @property
    def host(self):
        return self.heartbeat.host if self.heartbeat else None

    def process_report(self):
        """'; its process (pid p) is stopped' when its process runs on this machine, else ''."""
        state = self._process_state()
        return f"; its process (pid {self.heartbeat.pid}) is {state}" if state and state != "gone" else ""

    def _process_state(self):
        if self._process is None:
            return None
        try:
            return self._process.status() if self._process.is_running() else "gone"
        except psutil.NoSuchProcess:
            return "gone"
        except psutil.Error:
            return None


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _exit_fd(pid):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+, or the process is gone already: _process tells
        return None


def _silence_limit_from_environment():
    text = os.environ.get(SILENCE_LIMIT_VARIABLE, "")
    if not text:
        return DEFAULT_SILENCE_LIMIT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{SILENCE_LIMIT_VARIABLE}={text!r}: expected a number of seconds above 0")
    return seconds


def _keys_of(attempt):
    """The store keys of one launch of the job: torchrun --max-restarts keeps its store across the launches, so
    each launch keeps its heartbeats and failure notice apart (the next one reads the last one's notice)."""
    return f"{_KEYS}/attempt{attempt}"


class Watchdog:
    def __init__(self, rank, world_size, interval=2.0, silence_limit=None, attempt=0):
        self.rank, self.world_size = rank, world_size
        self._prefix, self._failure = _keys_of(attempt), f"{_keys_of(attempt)}/failure"
        self._previous_failure = f"{_keys_of(attempt - 1)}/failure" if attempt else None
        self.silence_limit = _silence_limit_from_environment() if silence_limit is None else silence_limit
        self.interval = min(interval, self.silence_limit / 4)
        self._activity = "start-up"
        self._beats = 0
        self._address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self._store = _BoundedStore(
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False,
                          timeout=datetime.timedelta(seconds=max(10.0, self.silence_limit))),
            limit=self.silence_limit)
        self._neighbour = _Neighbour((rank + 1) % world_size)
        self._store_host = None if store_hosted_by_launcher() else _Neighbour(0)  # rank 0, when it hosts the store
        self._stopped = threading.Event()
        self._exiting = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="megatron_ds-watchdog", daemon=True)

    @property
    def activity(self):
        return self._activity

    @activity.setter
    def activity(self, text):
        """What this rank is doing now; published at once, so a failure notice names the right step."""
        self._activity = text
        self._store.post(self._publish)  # not waited for: the watchdog thread notices a store that stopped answering

    def start(self):
        self._store.post(self._publish)
        self._thread.start()
        return self

    def stop(self):
        """Normal completion: stop, and tell the watching neighbour this silence is not a failure."""
        self._stopped.set()
        try:
            self._store.run(self._publish)
        except Exception:
            pass

    def report_failure(self, error):
        """Called by the main thread when this rank raises: tell everyone, once. A failed collective is
        usually the echo of another rank's death: wait for the watchers to name that rank first."""
        if _is_communication_error(error):
            deadline = time.monotonic() + self.silence_limit + 3 * self.interval
            while time.monotonic() < deadline:
                try:
                    self._exit_on_failure_notice()
                except Exception:
                    break
                time.sleep(self.interval / 2)
        notice = f"rank {self.rank} failed during {self.activity}: {type(error).__name__}: {error}"
        try:
            self._store.compare_set(self._failure, "", notice)
        except Exception:  # the store is gone too; the others will notice it themselves
            pass

    def previous_failure(self):
        """The failure notice of the launch before this one, where the store outlived it (torchrun's agent hosts it
        across --max-restarts); None when there was none or it is not there."""
        if self._previous_failure is None:
            return None
        try:
            return self._store.value(self._previous_failure) or None
        except Exception:
            return None

    def _publish(self, store):
        """Runs on the store thread, in call order: once stopped, every later heartbeat says done."""
        self._beats += 1
        text = _DONE if self._stopped.is_set() else _Heartbeat(self._beats, _HOST, os.getpid(), _MACHINE,
                                                               self._activity).text()
        store.set(f"{self._prefix}/beat/{self.rank}", text)

    def _run(self):
        try:
            while not self._stopped.is_set():
                self._store.run(self._publish)
                self._exit_on_failure_notice()
                self._learn_store_host()
                self._watch_neighbour()
                self._pause()
        except StoreUnresponsive:
            if not self._stopped.is_set():
                self._exit(self._unresponsive_store_notice())
        except Exception as error:  # the store's host (rank 0 or the launcher) is gone
            if not self._stopped.is_set():
                self._exit(self._lost_store_notice(error))

    def _watching(self):
        return self._neighbour.rank != self.rank and not self._neighbour.finished

    def _watch_neighbour(self):
        if not self._watching():
            return
        self._neighbour.saw(self._store.value(f"{self._prefix}/beat/{self._neighbour.rank}"))
        if self._neighbour.silent_for() > self.silence_limit and not self._neighbour.finished:
            self._declare(f"rank {self._neighbour.rank} stopped responding (no heartbeat for "
                          f"{self.silence_limit:.0f} s) during {self._neighbour.activity}"
                          + (f", on host {self._neighbour.host}" if self._neighbour.host else "")
                          + self._neighbour.process_report())

    def _pause(self):
        """One interval; a neighbour on this machine that dies meanwhile is reported at once."""
        if not self._watching():
            self._stopped.wait(self.interval)
        elif self._neighbour.died_within(self.interval):
            self._declare_neighbour_dead()

    def _declare_neighbour_dead(self):
        try:  # its last heartbeat is still in the store, fresher than the one read up to an interval ago
            self._neighbour.saw(self._store.value(f"{self._prefix}/beat/{self._neighbour.rank}"))
        except Exception:  # the store died with it (it was rank 0, hosting it)
            pass
        if not self._neighbour.finished:
            beat = self._neighbour.heartbeat
            self._declare(f"rank {self._neighbour.rank} failed during {beat.activity}: its process (pid {beat.pid}) "
                          f"on host {beat.host} died")

    def _learn_store_host(self):
        """Rank 0's host, read once, so that a frozen store can be blamed on a named host."""
        if self._store_host is None or self._store_host.heartbeat is not None:
            return
        if self._neighbour.rank == 0:
            self._store_host = self._neighbour  # watched already: its last activity is known too
        elif self.rank != 0:
            self._store_host.saw(self._store.value(f"{self._prefix}/beat/0"))

    def _declare(self, notice):
        """Post this rank's finding as the failure notice and exit with whichever notice came first. Not after
        stop(): a neighbour may then end normally."""
        if self._stopped.is_set():
            return
        try:
            notice = self._store.compare_set(self._failure, "", notice) or notice
        except Exception:  # the store is gone or frozen: this rank's own finding is still worth printing
            pass
        self._exit(notice)

    def _unresponsive_store_notice(self):
        where = f"the rendezvous store at {self._address}"
        silence = f"has not answered for {self.silence_limit:.0f} s"
        if self._store_host is None:
            return f"{where}, hosted by the torchrun agent, {silence}: the agent is hung or stopped"
        rank_0 = self._store_host
        watched = rank_0 is self._neighbour and rank_0.heartbeat  # else read once, at start-up: no news of it
        last_seen = f"; last seen during {rank_0.activity}" if watched else ""
        return (f"rank 0 on host {self._rank_0_host()} stopped responding: {where}, which its process hosts, "
                f"{silence}{last_seen}{rank_0.process_report()}")

    def _lost_store_notice(self, error):
        where = f"the rendezvous store at {self._address}"
        if self._store_host is None:
            return f"lost {where} ({type(error).__name__}): the torchrun agent hosting it died"
        return (f"rank 0 on host {self._rank_0_host()} died: lost {where}, which its process hosts "
                f"({type(error).__name__})")

    def _rank_0_host(self):
        return self._store_host.host or f"{os.environ['MASTER_ADDR']} (MASTER_ADDR)"

    def _exit_on_failure_notice(self):
        notice = self._store.value(self._failure)
        if notice:
            self._exit(notice)

    def _exit(self, reason):
        with self._exiting:  # the main thread (report_failure) and the watchdog thread may both get here
            print(f"megatron_ds: rank {self.rank} exiting while in {self.activity}: {reason}", file=sys.stderr,
                  flush=True)
            os._exit(1)


_COMMUNICATION_WORDS = ("connection", "peer", "socket", "broken pipe", "gloo", "nccl", "timed out", "timeout")


def _is_communication_error(error):
    """A collective that failed because some other rank went away (gloo, NCCL or the store)."""
    text = str(error).lower()
    return (isinstance(error, getattr(dist, "DistError", ())) or
            (isinstance(error, RuntimeError) and any(word in text for word in _COMMUNICATION_WORDS)))
