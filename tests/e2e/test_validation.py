"""pretrain.py on a bad command line under torchrun: every rank prints the problems and exits 2, before any process
group. The checks themselves are tested in-process in tests/unit/arguments/test_validation.py."""
import subprocess
import sys
from pathlib import Path

from tests.support.flags import HEADER, TINY_MODEL
from tests.support.launch import REPO, clean_env


def test_invalid_arguments_under_torchrun():
    """Every rank validates on its own and exits 2; nobody waits in a collective. The long monitor interval
    lets all four ranks print before torchrun tears down the survivors of the first failure."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "4", "--monitor-interval", "5", "pretrain.py",
               *TINY_MODEL, "--tensor-model-parallel-size", "3"]
    result = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=60, env=clean_env())
    output = result.stdout
    assert result.returncode != 0, output
    assert output.count(HEADER) == 4, output
    assert output.count("--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 does not divide "
                        "the world size 4") == 4, output
    assert output.count("--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3") == 4, output
