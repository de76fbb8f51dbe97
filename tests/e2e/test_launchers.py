"""Launch forms and hang safety, with real processes: mpirun, a two-node run simulated on one machine
(two torchrun launchers of 2 ranks each meeting at 127.0.0.1), and a rank killed mid-training."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_ds.launch.runtime import free_port
from tests.support.launch import BIN, REPO, assert_succeeded, launch, losses

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--mock-data", "--vocab-size", "250", "--make-vocab-size-divisible-by", "128",
         "--log-interval", "1", "--eval-interval", "0", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2"]
ITERATIONS = 5
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def deepspeed_losses():
    result = launch(4, FLAGS + ["--train-iters", str(ITERATIONS)], launcher="deepspeed")
    assert_succeeded(result, tail=3000)
    return losses(result.stdout)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed (.ci/run installs it)")
def test_mpirun_matches_the_deepspeed_launcher(deepspeed_losses):
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", "OMP_NUM_THREADS=1",
               "-x", "PATH", sys.executable, "pretrain.py", *FLAGS, "--train-iters", str(ITERATIONS),
               "--distributed-port", str(free_port())]
    result = subprocess.run(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    assert_succeeded(result, tail=3000)
    assert losses(result.stdout) == deepspeed_losses


def _start_nodes(extra, port):
    """Two torchrun launchers, one per simulated node; node 1 holds ranks 2 and 3 (the last stage)."""
    return [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node),
                              "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                              "pretrain.py", *FLAGS, *extra],
                             cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for node in (0, 1)]


def test_simulated_two_node_run_matches_a_single_launcher(deepspeed_losses):
    nodes = _start_nodes(["--train-iters", str(ITERATIONS)], free_port())
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert losses(outputs[1]) == deepspeed_losses


def _rank_process(launcher, rank):
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    return None


def test_a_killed_rank_stops_every_rank_within_the_bound():
    nodes = _start_nodes(["--train-iters", "100000"], free_port())
    node1_output = []
    for line in nodes[1].stdout:  # wait until training is under way
        node1_output.append(line)
        if " iteration 3/" in line:
            break
    victim = _rank_process(nodes[1], 3)
    assert victim is not None, "".join(node1_output[-50:])
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    outputs = [node.communicate(timeout=150)[0] for node in nodes]
    elapsed = time.monotonic() - killed_at
    assert elapsed < 120, f"ranks took {elapsed:.0f} s to stop"
    assert all(node.returncode != 0 for node in nodes), [node.returncode for node in nodes]
    notices = re.findall(r"megatron_ds: rank (\d) exiting while in iteration \d+: (rank \d (stopped responding|failed "
                         r"during)[^\n]*)", outputs[0])
    # the first node-0 rank to see the notice exits; its launcher may then SIGTERM the other before it prints
    assert notices and {rank for rank, _, _ in notices} <= {"0", "1"}, outputs[0][-3000:]
