"""pretrain.py itself on a bad command line: exit status 2, the message on stderr, no traceback, before any process
group. Under torchrun: tests/e2e/test_validation.py; the checks themselves are tested in-process in
tests/unit/arguments/test_validation.py."""
import json
import subprocess
import sys

from tests.support.flags import HEADER, TINY_MODEL
from tests.support.launch import REPO, clean_env


def test_rank_of_a_launch_exits_2_naming_every_problem(tmp_path):
    """Rank 0 of a 2-rank launch with a layout error and a DeepSpeed JSON conflict."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8}))
    argv = TINY_MODEL + ["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                         "--deepspeed_config", str(ds)]
    result = subprocess.run([sys.executable, "pretrain.py", *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env=clean_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0"))
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 2, result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert result.stderr.splitlines()[0] == HEADER and problems == [
        "  - --num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
        f'  - --global-batch-size 4 conflicts with "train_batch_size": 8 in {ds}'], result.stderr


def test_malformed_launcher_variable_exits_2():
    result = subprocess.run([sys.executable, "pretrain.py", *TINY_MODEL], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env=clean_env(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_NODEID="0",
                                                      SLURM_TASKS_PER_NODE="two", SLURM_JOB_NODELIST="n1"))
    assert "Traceback" not in result.stderr and result.returncode == 2, result.stderr
    assert result.stderr.startswith("megatron_ds: error: ") and "SLURM_TASKS_PER_NODE" in result.stderr
