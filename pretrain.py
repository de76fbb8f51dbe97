"""GPT pretraining with Megatron tensor parallelism inside DeepSpeed's pipeline and ZeRO engine.

    deepspeed --num_gpus 4 pretrain.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...
    torchrun --nproc_per_node 4 pretrain.py ...
"""
import sys

from megatron_ds.launch.launcher_env import LauncherError
from megatron_ds.launch.runtime import prepare_host

try:
    prepare_host()  # before DeepSpeed is imported: it picks its accelerator at import time
except LauncherError as error:
    print(f"megatron_ds: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)

from megatron_ds.training import pretrain  # noqa: E402

if __name__ == "__main__":
    sys.exit(pretrain())
