"""Plan a 3D-parallel run: exact parameters, memory per device, FLOPs, communication and estimated time for
pretrain.py's model/parallel/batch flags on a cluster; --search ranks every layout; --instantiate builds
every pipeline stage on the meta device and checks the parameter counts. See docs/planning.md.

    python tools/plan.py --num-layers 105 --hidden-size 20480 --num-attention-heads 128 --seq-length 2048 \
        --vocab-size 50257 --bf16 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 35 \
        --micro-batch-size 1 --global-batch-size 1920 --recompute-granularity full \
        --world-size 2240 --device a100-80gb [--search] [--instantiate] [--json]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ds.launch.runtime import prepare_host  # noqa: E402

prepare_host()  # before DeepSpeed is imported: no GPU here means its CPU accelerator, without a warning

from megatron_ds.planning.plan_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
