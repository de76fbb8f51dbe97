"""Hang safety: a rank that raises or dies makes every rank exit within a bounded time, with a message
naming the failed rank and what it was doing, instead of waiting in a collective (NCCL waits forever).

Every rank runs a daemon thread that talks to the rendezvous store (a second client of the TCPStore at
MASTER_ADDR:MASTER_PORT, so it works while the main thread sits in a collective):
- it publishes a heartbeat counter and its current activity;
- it watches one neighbour's heartbeat (rank + 1, a ring: O(1) store traffic per rank); a neighbour
  silent for `silence_limit` seconds is declared dead in a shared failure notice;
- it polls the failure notice; once set, it prints it and ends the process with status 1.
A rank that raises posts the notice itself before exiting. Losing the store (its host died) also ends
the process.
"""
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

_PREFIX = "megatron_ds/watchdog"
_FAILURE = f"{_PREFIX}/failure"
_DONE = "done"


class Watchdog:
    def __init__(self, rank, world_size, interval=2.0, silence_limit=30.0):
        self.rank, self.world_size = rank, world_size
        self.interval, self.silence_limit = interval, silence_limit
        self._activity = "start-up"
        self._lock = threading.Lock()
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None,
                                    is_master=False, timeout=datetime.timedelta(seconds=max(10.0, silence_limit)))
        self._beats = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron_ds-watchdog", daemon=True)

    @property
    def activity(self):
        return self._activity

    @activity.setter
    def activity(self, text):
        """What this rank is doing now; published at once, so a failure notice names the right step."""
        self._activity = text
        self._beat()

    def start(self):
        self._beat()
        self._thread.start()
        return self

    def stop(self):
        """Normal completion: stop, and tell the watching neighbour this silence is not a failure."""
        self._stopped.set()
        try:
            self._store.set(f"{_PREFIX}/beat/{self.rank}", _DONE)
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
            self._store.compare_set(_FAILURE, "", notice)
        except Exception:  # the store is gone too; the others will notice it themselves
            pass

    def _beat(self):
        with self._lock:  # the main thread (activity changes) and the watchdog thread both publish
            self._beats += 1
            self._store.set(f"{_PREFIX}/beat/{self.rank}", f"{self._beats}|{self._activity}")

    def _run(self):
        neighbour = (self.rank + 1) % self.world_size
        last_seen, last_change = None, time.monotonic()
        try:
            while not self._stopped.wait(self.interval):
                self._beat()
                self._exit_on_failure_notice()
                if neighbour == self.rank:
                    continue
                seen = self._store.get(f"{_PREFIX}/beat/{neighbour}").decode() if self._store.check(
                    [f"{_PREFIX}/beat/{neighbour}"]) else None
                if seen == _DONE:
                    neighbour = self.rank  # finished normally: nothing more to watch
                elif seen != last_seen:
                    last_seen, last_change = seen, time.monotonic()
                elif time.monotonic() - last_change > self.silence_limit:
                    activity = seen.split("|", 1)[1] if seen else "start-up"
                    self._store.compare_set(_FAILURE, "", f"rank {neighbour} stopped responding (no heartbeat "
                                                          f"for {self.silence_limit:.0f} s) during {activity}")
        except Exception as error:  # the store's host (rank 0 or the launcher) is gone
            if not self._stopped.is_set():
                self._exit(f"lost the rendezvous store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                           f"({type(error).__name__}); the rank or launcher hosting it died")

    def _exit_on_failure_notice(self):
        if self._store.check([_FAILURE]):
            notice = self._store.get(_FAILURE).decode()
            if notice:
                self._exit(notice)

    def _exit(self, reason):
        print(f"megatron_ds: rank {self.rank} exiting while in {self.activity}: {reason}", file=sys.stderr,
              flush=True)
        os._exit(1)


_COMMUNICATION_WORDS = ("connection", "peer", "socket", "broken pipe", "gloo", "nccl", "timed out", "timeout")


def _is_communication_error(error):
    """A collective that failed because some other rank went away (gloo, NCCL or the store)."""
    text = str(error).lower()
    return (isinstance(error, getattr(dist, "DistError", ())) or
            (isinstance(error, RuntimeError) and any(word in text for word in _COMMUNICATION_WORDS)))
