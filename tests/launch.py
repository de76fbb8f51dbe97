"""Launch pretrain.py through a real launcher (torchrun or deepspeed) and read its log."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "MPI_", "SLURM_")


def launch(nproc, flags, launcher="torchrun", timeout=300, env=None, program=("pretrain.py",)):
    """Run pretrain.py (or program, e.g. ("-m", "tests.backdated_start", "61")) on nproc local ranks; return the
    CompletedProcess (stdout and stderr merged)."""
    from tests.distributed import free_port
    port = str(free_port())
    if launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port]
    else:
        command = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    # its own session, so a launch that overruns is killed whole (the launcher alone would leave its ranks)
    with subprocess.Popen(command + [*program, *flags], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise AssertionError(f"the launch did not finish within {timeout} s; its last output:\n"
                                 f"{output[-12000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def clean_env(**extra):
    """This environment without any launcher's variables, one thread per process, plus extra."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_alone(program, flags, timeout=120):
    """python <program> <flags> as a single process without a launcher (rank 0 of 1, on a free port); the
    CompletedProcess, stdout and stderr merged."""
    from tests.distributed import free_port
    return subprocess.run([sys.executable, *program, *flags, "--distributed-port", str(free_port())], cwd=REPO,
                          env=clean_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def losses(output):
    """{iteration: lm loss} from the iteration lines of a run's output."""
    return {int(it): float(loss) for it, loss in LOSS_LINE.findall(output)}
