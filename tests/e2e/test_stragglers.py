"""--log-straggler on real ranks: one of 2 ranks (DP 2, a core each) slowed from outside (SIGSTOP / SIGCONT cycling,
stopped 30% of the time: 1 / 0.7 = 1.43x its compute time) is named within three log intervals, with a ratio (the
median of its warnings) within 15% of the slowdown applied (measured as the share it was really stopped); without a
slowdown no warning in 200 iterations; the detector switched on and off through its port."""
import os
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.request

import psutil

from tests.support.distributed import free_port
from tests.support.launch import BIN, REPO, kill_session, lines_within

# a core each: with more ranks than cores the OS shares the cores unevenly, which looks like (and is) stragglers, and
# the other ranks take a stopped rank's core, which shrinks its ratio
RANKS = 2
# the test's own process and torchrun's agent share the 2 cores with the ranks: the slowed rank measures 1.28-1.34x
# for 1.38-1.43x applied here, near the default 1.2 threshold; 1.15 keeps one dipping interval from resetting the
# count
LOOSER = ["--straggler-threshold", "1.15"]
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--vocab-size", "250",
         "--eval-interval", "0", "--log-straggler"]
WARNING = re.compile(r"WARNING: straggler: rank (\d) \(\S+, stage 0\) computed ([0-9.]+)x the median of its peers")


def _launch(iterations, ranks, log_interval, extra=()):
    command = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(free_port()), "pretrain.py",
               *FLAGS, "--train-iters", str(iterations), "--log-interval", str(log_interval), *extra]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _rank_process(launcher_pid, rank):
    for child in psutil.Process(launcher_pid).children():
        if child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no rank {rank} among the launcher's children")


def _cycle(process, stopped_share, period, done, applied):
    """Stop the process for stopped_share of every period until done is set; applied[0]: the share it really was
    stopped (the sleeps overshoot)."""
    stopped = running = 0.0
    while not done.is_set() and process.is_running():
        start = time.perf_counter()
        try:
            process.send_signal(signal.SIGSTOP)
            time.sleep(period * stopped_share)
            middle = time.perf_counter()
            process.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:  # the run ended
            return
        time.sleep(period * (1 - stopped_share))
        stopped, running = stopped + middle - start, running + time.perf_counter() - middle
        applied[0] = stopped / (stopped + running)


def test_a_rank_slowed_from_outside_is_named_with_its_slowdown():
    done, applied = threading.Event(), [None]
    lines = []
    with _launch(iterations=200, ranks=RANKS, log_interval=20, extra=LOOSER) as launch:
        try:
            for line in lines_within(launch, 400):
                lines.append(line)
                if "straggler check, iterations 1-20" in line:  # the first interval unslowed, warm-up included
                    victim = _rank_process(launch.pid, RANKS - 1)
                    threading.Thread(target=_cycle, args=(victim, 0.3, 0.02, done, applied),
                                     daemon=True).start()
            launch.wait(timeout=60)
        finally:
            done.set()
            if launch.poll() is None:
                kill_session(launch)
    output = "".join(lines)
    assert launch.returncode == 0, output[-4000:]
    warnings = WARNING.findall(output)
    assert warnings, output[-4000:]
    checks_before = len(re.findall(r"straggler check, iterations", output[:output.index("WARNING: straggler")]))
    # before the slowdown, then <= 6: the slowdown starts when this test reads the first check's line, the next
    # interval may straddle it, and the warning needs 2 slowed intervals in a row, which a dipping one (1.10x under
    # CI's load, for 1.43x applied) resets (CI runs of 2026-12-06 took 4 and 5)
    assert checks_before <= 1 + 6, [line for line in lines if "straggler" in line]
    assert {rank for rank, _ in warnings} == {str(RANKS - 1)}, warnings
    slowdown = 1 / (1 - applied[0])
    # the median of the warnings: the first slowed interval may straddle the start of the slowdown (seen: 1.17x then
    # 1.25, 1.32, 1.25x for 1.40x applied in a CI run)
    reported = statistics.median(float(ratio) for _, ratio in warnings)
    assert abs(reported / slowdown - 1) <= 0.15, (warnings, slowdown)


def test_no_warning_without_a_slowdown():
    with _launch(iterations=200, ranks=RANKS, log_interval=10, extra=["--straggler-ctrlr-port", str(free_port())]) \
            as launch:
        output, _ = launch.communicate(timeout=400)
    assert launch.returncode == 0, output[-4000:]
    assert len(re.findall(r"straggler check, iterations", output)) == 20
    assert "WARNING: straggler" not in output, [line for line in output.splitlines() if "straggler" in line]


def _switch(port):
    """What a user's `curl <rank 0>:<port>` does; the reply's text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=30) as reply:
        return reply.read().decode()


def test_the_detector_starts_off_and_is_switched_on_and_off_through_its_port():
    port, replies, lines = free_port(), [], []
    extra = ["--disable-straggler-on-startup", "--straggler-ctrlr-port", str(port)]
    with _launch(iterations=40, ranks=RANKS, log_interval=4, extra=extra) as launch:
        try:
            for line in lines_within(launch, 400):
                lines.append(line)
                if re.search(r"iteration\s+(8|24)/", line):  # printed every log interval
                    replies.append(_switch(port))
            launch.wait(timeout=60)
        finally:
            if launch.poll() is None:
                kill_session(launch)
    output = "".join(lines)
    assert launch.returncode == 0, output[-4000:]
    assert replies == ["straggler detector on from the next log interval\n",
                       "straggler detector off from the next log interval\n"]
    reports = re.findall(r"straggler detector switched (on|off) at iteration (\d+)|straggler check, iterations "
                         r"(\d+)-(\d+)", output)
    # nothing before it is switched on, then one check per interval, nothing after it is switched off. The
    # iteration line is printed before that interval's exchange, so a quick switch can land in the interval whose
    # line the test saw (seen in CI: off at 24) or a later one.
    (first, on), (last, off) = reports[0][:2], reports[-1][:2]
    assert first == "on" and last == "off" and 8 <= int(on) < int(off) and int(off) >= 24, reports
    checks = [(int(start), int(end)) for _, _, start, end in reports[1:-1]]
    assert checks == [(start, start + 3) for start in range(int(on) + 1, int(off) - 3, 4)], reports
