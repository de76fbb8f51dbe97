"""A failed rank restarted without a person: a rank killed with SIGKILL during training, under torchrun
--max-restarts 2 and under tools/supervise.py around the deepspeed launcher. The job starts again, resumes from
the last checkpoint in --save without --load (the folder's lock taken over from the dead run), says which restart
it is, after what and which iterations it runs again, and finishes; every iteration's lm loss, those run twice
included, is the straight run's bitwise. Twice in one run as well; a third failure with --max-restarts 2 stops
the job with the reason."""
import os
import re
import signal
import subprocess
import sys

import psutil

from tests.support.distributed import free_port
from tests.support.launch import BIN, REPO, assert_succeeded, kill_session, launch, lines_within, losses
from tests.support.layouts import COMMON

ITERATIONS = 20
FLAGS = [*COMMON, "--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256",
         "--save-interval", "5"]
FLAGS[FLAGS.index("--train-iters") + 1] = str(ITERATIONS)
ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|", re.M)
_straight = []


def straight_losses(tmp_path_factory):
    if not _straight:
        result = launch(2, FLAGS + ["--save", str(tmp_path_factory.mktemp("straight"))])
        assert_succeeded(result, tail=4000)
        _straight.append(losses(result.stdout))
    return _straight[0]


def run_with_kills(command, kills, timeout=400):
    """Run the launch; each time an iteration line reaches kills[0] (once the previous kill's restart has begun),
    SIGKILL the launcher's last rank process. Returns (exit status, output)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    lines, pending, armed = [], list(kills), True
    with subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as process:
        try:
            for line in lines_within(process, timeout):
                lines.append(line)
                armed = armed or line.startswith("megatron_ds: restart ")
                reached = ITERATION.match(line)
                if reached and armed and pending and int(reached.group(1)) >= pending[0]:
                    _kill_a_rank(process.pid)
                    pending.pop(0)
                    armed = False
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                kill_session(process)
    return process.returncode, "".join(lines)


def _kill_a_rank(launcher_pid):
    ranks = [child for child in psutil.Process(launcher_pid).children(recursive=True) if _is_rank(child)]
    ranks[-1].send_signal(signal.SIGKILL)


def _is_rank(process):
    """A rank runs pretrain.py as its script, and its parent (a launcher) does not (a forked helper of a rank
    does)."""
    try:
        return _script(process) == "pretrain.py" and _script(process.parent()) != "pretrain.py"
    except psutil.NoSuchProcess:
        return False


def _script(process):
    """The first argument after the interpreter's options: the script, or -m's module."""
    arguments = process.cmdline()[1:]
    return next((argument for argument in arguments if not argument.startswith("-")), None)


def torchrun(save, max_restarts=2):
    """torchrun's agent looks at its workers every second (its default 0.1 s raced the watchdog's pidfd, which
    names the dead rank in the notice the restart line reports)."""
    return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "--max-restarts",
            str(max_restarts), "--monitor-interval", "1", "pretrain.py", *FLAGS, "--save", str(save)]


def assert_every_loss_is_the_straight_runs(output, straight):
    printed = [(int(iteration), float(loss)) for iteration, loss in ITERATION.findall(output)]
    assert sorted({iteration for iteration, _ in printed}) == list(range(1, ITERATIONS + 1)), output[-4000:]
    assert all(loss == straight[iteration] for iteration, loss in printed), (printed, straight)
    return printed


def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_ends_as_the_straight_run(tmp_path, tmp_path_factory):
    status, output = run_with_kills(torchrun(tmp_path), kills=[8])
    assert status == 0, output[-6000:]
    printed = assert_every_loss_is_the_straight_runs(output, straight_losses(tmp_path_factory))
    restart = re.search(r"restart 1 of 2 \(torchrun\) after rank (\d) failed during iteration (\d+): its process "
                        r"\(pid \d+\) on host \S+ died, resuming from iteration 5; iterations 6-(\d+) run again "
                        r"\((\d+) since the last save\)", output)
    assert restart, output[-6000:]
    failed = int(restart.group(2))
    assert restart.group(3) == str(failed) and int(restart.group(4)) == failed - 5
    # the failed iteration's line is printed before the restart when the kill lands between that line and the
    # next iteration's heartbeat; every iteration finished after the save is printed twice
    before_restart = [int(iteration) for iteration, _ in ITERATION.findall(output[:restart.start()])]
    assert before_restart[5:] in (list(range(6, failed)), list(range(6, failed + 1))), (before_restart, failed)
    assert len(printed) == ITERATIONS + len(before_restart) - 5
    assert "took over the lock" in output


def test_a_killed_rank_under_async_save_resumes_from_the_last_complete_checkpoint(tmp_path, tmp_path_factory):
    """--async-save writes each checkpoint in the background: the kill (at iteration 12 or later) may land while
    the save of iteration 10 is still being written; the restart resumes from the last complete one."""
    status, output = run_with_kills(torchrun(tmp_path) + ["--async-save"], kills=[12])
    assert status == 0, output[-6000:]
    assert_every_loss_is_the_straight_runs(output, straight_losses(tmp_path_factory))
    assert re.search(r"restart 1 of 2 \(torchrun\) after rank \d failed during iteration \d+: its process \(pid \d+\) "
                     r"on host \S+ died, resuming from iteration (5|10); iterations", output), output[-6000:]


def test_two_failures_in_one_run_and_a_third_stops_the_job_with_its_reason(tmp_path, tmp_path_factory):
    status, output = run_with_kills(torchrun(tmp_path), kills=[7, 14])
    assert status == 0, output[-6000:]
    assert_every_loss_is_the_straight_runs(output, straight_losses(tmp_path_factory))
    assert re.search(r"restart 1 of 2 \(torchrun\) after rank \d failed during iteration", output)
    assert re.search(r"restart 2 of 2 \(torchrun\) after rank \d failed during iteration 1\d: its process", output)

    status, output = run_with_kills(torchrun(tmp_path / "third"), kills=[4, 4, 4])
    assert status != 0
    assert "restart 2 of 2" in output and "restart 3" not in output, output[-6000:]
    last_launch = output[output.index("restart 2 of 2"):]
    # the watchdog names the dead rank, unless torchrun's agent saw the death first and stopped the others; then
    # torchrun's own report names the signal
    assert re.search(r"megatron_ds: rank \d exiting while in iteration \d+: rank \d failed during iteration \d+: "
                     r"its process \(pid \d+\) on host \S+ died", last_launch) or re.search(
        r"exitcode\s*: -9 \(pid: \d+\)", last_launch), last_launch[-4000:]


def test_supervise_restarts_the_deepspeed_launcher_after_a_killed_rank(tmp_path, tmp_path_factory):
    command = [sys.executable, "tools/supervise.py", "--max-restarts", "3", "--", str(BIN / "deepspeed"),
               "--num_gpus", "2", "--master_port", str(free_port()), "pretrain.py", *FLAGS, "--save", str(tmp_path)]
    status, output = run_with_kills(command, kills=[8])
    assert status == 0, output[-6000:]
    assert_every_loss_is_the_straight_runs(output, straight_losses(tmp_path_factory))
    assert re.search(r"supervise: launch 1 failed \(status \d+\): rank \d failed during iteration \d+: its process "
                     r"\(pid \d+\) on host \S+ died; starting restart 1 of 3", output), output[-6000:]
    assert re.search(r"restart 1 of 3 \(tools/supervise.py\) after rank \d failed during iteration (\d+): .*, "
                     r"resuming from iteration 5; iterations 6-\1 run again", output), output[-6000:]


def test_supervise_stops_after_max_restarts_and_leaves_other_statuses_alone(tmp_path):
    always_fails = [sys.executable, "-c", "import sys; print('megatron_ds: error: bad step', file=sys.stderr); "
                                          "sys.exit(1)"]
    result = subprocess.run([sys.executable, "tools/supervise.py", "--max-restarts", "2", "--", *always_fails],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("starting restart") == 2
    assert "supervise: stopping: launch 3 failed (status 1) after 2 restart(s), the --max-restarts 2: bad step" in \
        result.stderr
    refused = subprocess.run([sys.executable, "tools/supervise.py", "--", sys.executable, "-c", "raise SystemExit(2)"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "starting restart" not in refused.stderr
