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
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def losses(output):
    """{iteration: lm loss} from the iteration lines of a run's output."""
    return {int(it): float(loss) for it, loss in LOSS_LINE.findall(output)}
