"""Hang and death detection under the deepspeed launcher, with real processes: there rank 0's process hosts the
rendezvous store, so a stopped rank 0 freezes the store; and the launcher tears the job down about a second after
a rank dies, naming the wrong local rank. The watchdog (megatron_ds/launch/watchdog.py) must name the rank."""
import os
import re
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest

from megatron_ds.launch.runtime import free_port
from megatron_ds.launch.watchdog import SILENCE_LIMIT_VARIABLE
from tests.support.launch import BIN, REPO

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3", "--mock-data", "--vocab-size", "250",
         "--make-vocab-size-divisible-by", "128", "--log-interval", "1", "--eval-interval", "0",
         "--tensor-model-parallel-size", "2", "--train-iters", "100000"]
SILENCE_LIMIT = 8  # seconds; the default 30 s would only make the test slower
HOST = re.escape(socket.gethostname())


class TrainingJob:
    """`deepspeed --num_gpus 2 pretrain.py` in its own session, its output read as it comes; leaving the block
    kills whatever is left of it, stopped processes included."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               SILENCE_LIMIT_VARIABLE: str(SILENCE_LIMIT)}
        self.launcher = subprocess.Popen(
            [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "pretrain.py", *FLAGS],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        for signum in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.launcher.pid, signum)
            except ProcessLookupError:
                pass
        self.launcher.wait()

    def _read(self):
        for line in self.launcher.stdout:
            self._lines.append(line)

    def output(self):
        return "".join(self._lines)

    def wait_for(self, text, timeout=240):
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.launcher.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.2)

    def finish(self, timeout):
        """The launcher's exit status, once its output has been read to the end."""
        returncode = self.launcher.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return returncode

    def rank_process(self, rank):
        """The process the launcher started for rank (one node: local rank = global rank), not its data workers."""
        for process in psutil.Process(self.launcher.pid).children(recursive=True):
            try:
                if (f"--local_rank={rank}" in process.cmdline()
                        and not any(arg.startswith("--local_rank=") for arg in process.parent().cmdline())):
                    return process
            except psutil.Error:  # a data loader worker that just ended
                continue
        raise AssertionError(f"no process for rank {rank}\n{self.output()[-3000:]}")


def test_a_stopped_rank_0_is_named_by_the_other_ranks_within_the_silence_limit():
    with TrainingJob() as job:
        job.wait_for(" iteration 3/")
        rank_0, rank_1 = job.rank_process(0), job.rank_process(1)
        rank_0.suspend()  # kill -STOP: rank 0 and the store it hosts freeze
        stopped_at = time.monotonic()
        try:
            rank_1.wait(timeout=SILENCE_LIMIT + 30)
        except psutil.TimeoutExpired:
            pytest.fail(f"rank 1 is still running\n{job.output()[-3000:]}")
        found_after = time.monotonic() - stopped_at
        rank_0.kill()  # else the launcher waits 30 s for the stopped rank to take its SIGTERM
        returncode = job.finish(timeout=60)
    assert found_after < SILENCE_LIMIT + 10, f"rank 1 took {found_after:.0f} s to exit"
    assert returncode != 0
    assert re.search(rf"megatron_ds: rank 1 exiting while in iteration \d+: rank 0 on host {HOST} stopped responding: "
                     rf".* has not answered for {SILENCE_LIMIT} s; last seen during [^;]+; its process "
                     rf"\(pid {rank_0.pid}\) is stopped", job.output()), \
        job.output()[-3000:]


def test_a_killed_rank_is_named_by_its_global_rank_before_the_launcher_tears_down():
    with TrainingJob() as job:
        job.wait_for(" iteration 3/")
        victim = job.rank_process(1)
        victim.kill()
        returncode = job.finish(timeout=60)
    assert returncode != 0
    notice = re.search(rf"megatron_ds: rank 0 exiting while in iteration \d+: rank 1 failed during iteration \d+: "
                       rf"its process \(pid {victim.pid}\) on host {HOST} died", job.output())
    assert notice, job.output()[-3000:]
    assert notice.start() < job.output().find("Killing subprocess"), job.output()[-3000:]  # the launcher's teardown
