"""Launch pretrain.py on several real ranks (forked by tests/support/zygote.py, or under torchrun or deepspeed) and
read its log; run tools/generate.py; check that a run succeeded."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "MPI_", "SLURM_")


def launch(nproc, flags, launcher="torchrun", timeout=300, env=None, program=("pretrain.py",)):
    """Run pretrain.py (or program, e.g. ("-m", "tests.support.backdated_start", "61")) on nproc local ranks; return
    the CompletedProcess (stdout and stderr merged). A launch under "torchrun" without an environment of its own
    forks its ranks from tests/support/zygote.py (imports paid once per test session; TESTS_REAL_LAUNCHER=1 starts
    torchrun instead); one with its own environment (a hook that must run at interpreter start, or torchrun's own
    report), or under "deepspeed", starts the real launcher."""
    from tests.support.distributed import free_port
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if launcher == "torchrun" and env is None and not os.environ.get("TESTS_REAL_LAUNCHER"):
        return _launch_forked(nproc, program, flags, timeout, environment)
    port = str(free_port())
    if launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port]
    else:
        command = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port]
    # its own session, so a launch that overruns is killed whole (the launcher alone would leave its ranks)
    with subprocess.Popen(command + [*program, *flags], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(process)
            output, _ = process.communicate()
            raise AssertionError(f"the launch did not finish within {timeout} s; its last output:\n"
                                 f"{output[-12000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, output)


_zygote = []  # the session's tests/support/zygote.py process, started by the first forked launch


def _zygote_process():
    if not _zygote or _zygote[0].poll() is not None:
        _zygote[:] = [subprocess.Popen([sys.executable, "-m", "tests.support.zygote"], cwd=REPO, text=True,
                                       env=clean_env(PYTHONUNBUFFERED="1"), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE)]
    return _zygote[0]


def _launch_forked(nproc, program, flags, timeout, environment):
    zygote = _zygote_process()
    answer, output = request_launch(zygote, nproc, program, flags, environment, timeout)
    if answer is None:
        raise AssertionError(f"tests/support/zygote.py died (exit {zygote.wait()}); the launch's output:\n"
                             f"{output[-12000:]}")
    if answer["timed_out"]:
        raise AssertionError(f"the launch did not finish within {timeout} s; its last output:\n{output[-12000:]}")
    return subprocess.CompletedProcess(["tests/support/zygote.py", str(nproc), *program, *flags],
                                       answer["returncode"], output)


def request_launch(server, nproc, program, flags, environment, timeout):
    """One launch through a tests/support/zygote.py request loop (server: its Popen, stdin and stdout piped): its
    answer ({"returncode": ..., "timed_out": ...}; None where the server died) and the launch's output."""
    with tempfile.NamedTemporaryFile("r", prefix="launch-", suffix=".log") as log:
        request = {"nproc": nproc, "program": list(program), "argv": [os.fspath(flag) for flag in flags],
                   "environ": environment, "log": log.name, "timeout": timeout}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        output = log.read()
    return (json.loads(answer) if answer else None), output


def clean_env(**extra):
    """This environment without any launcher's variables, one thread per process, plus extra."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_alone(program, flags, timeout=120):
    """python <program> <flags> as a single process without a launcher (rank 0 of 1, on a free port); the
    CompletedProcess, stdout and stderr merged."""
    from tests.support.distributed import free_port
    return subprocess.run([sys.executable, *program, *flags, "--distributed-port", str(free_port())], cwd=REPO,
                          env=clean_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def run_generate(nproc, *argv):
    """tools/generate.py with argv, under torchrun on nproc ranks (one: python alone); the JSON records it prints."""
    from tests.support.distributed import free_port
    command = ([str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
               if nproc > 1 else [sys.executable])
    result = subprocess.run(command + ["tools/generate.py", *map(str, argv)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=3000)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def assert_succeeded(result, tail=3000):
    """result (a CompletedProcess) exited 0; else AssertionError with the last `tail` characters of its stdout and
    of its stderr where it has one (tail=None: all of them)."""
    if result.returncode != 0:
        raise AssertionError(_last(result.stdout, tail) + _last(result.stderr, tail))


def _last(text, tail):
    text = text or ""
    return text if tail is None else text[-tail:]


def losses(output):
    """{iteration: lm loss} from the iteration lines of a run's output."""
    return {int(it): float(loss) for it, loss in LOSS_LINE.findall(output)}


def lines_within(process, timeout):
    """The lines of process.stdout as they come, for at most timeout seconds in all: past it, the process's session is
    killed (start it with start_new_session=True) and AssertionError raised with its last lines, so that a launch that
    hangs fails its test instead of holding the suite until CI's limit."""
    arrived = queue.Queue()

    def read():
        for line in process.stdout:
            arrived.put(line)
        arrived.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline, seen = time.monotonic() + timeout, []
    while True:
        try:
            line = arrived.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            kill_session(process)
            raise AssertionError(f"no end to the output within {timeout} s; its last lines:\n"
                                 f"{''.join(seen[-100:])}") from None
        if line is None:
            return
        seen.append(line)
        yield line


def kill_session(process):
    """SIGKILL the process's session (the launcher and every rank it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
