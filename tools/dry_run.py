"""Check a launch on this machine before it is queued: pretrain.py's start-up for chosen ranks of the launch's
world (torch's fake process group, the model under FakeTensorMode), the ranks' process groups checked against
each other and DeepSpeed's grid, each stage's parameters against the planner. See docs/planning.md.

    python tools/dry_run.py <pretrain.py flags> --world-size 2240 [--gpus-per-node 8] [--device a100-80gb] \
        [--ranks stages|all|0,5,8-11] [--jobs J] [--json FILE]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ds.launch.runtime import prepare_host  # noqa: E402

prepare_host()  # before DeepSpeed is imported: no GPU here means its CPU accelerator, without a warning

from megatron_ds.planning.dry_run.launch_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
