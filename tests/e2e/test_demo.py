"""The README's demo command (scripts/demo.sh: deepspeed launcher, TP 2 x PP 2, 4 ranks, DeepSpeed JSON)
runs for a few iterations and the loss goes down; its TensorBoard scalars plot to a PNG; bench/fp8_convergence.py,
which runs the demo per FP8 recipe, reads its losses."""
import os
import subprocess
import sys

from bench.fp8_convergence import ITERATION_LINE
from tests.support.launch import REPO, assert_succeeded, losses


def test_demo_trains_and_loss_falls(tmp_path):
    environment = {**os.environ, "VENV": sys.prefix, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    board = tmp_path / "board"
    result = subprocess.run(["bash", "scripts/demo.sh", "--train-iters", "30", "--log-interval", "5",
                             "--eval-interval", "30", "--tensorboard-dir", str(board)],
                            cwd=REPO, env=environment, timeout=400, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert_succeeded(result, tail=4000)
    trajectory = losses(result.stdout)
    assert sorted(trajectory) == list(range(5, 31, 5)), result.stdout[-4000:]
    assert trajectory[30] < trajectory[5] - 0.5, trajectory
    assert "validation loss at iteration 30" in result.stdout
    assert {int(it): float(loss) for it, loss in ITERATION_LINE.findall(result.stdout)} == trajectory

    png = tmp_path / "metrics.png"
    plot = subprocess.run([sys.executable, "tools/plot_metrics.py", "--tensorboard-dir", str(board),
                           "--output", str(png)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_succeeded(plot, tail=None)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
