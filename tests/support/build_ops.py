"""Build (or load from the cache) the JIT-compiled ops the tests use, once, before the suite runs (scripts/test.sh).
torch's JIT build holds a lock file while it compiles: a test launch killed at its timeout in the middle of the
first build would leave the lock behind, and every later build of that op would wait on it forever.

    python -m tests.support.build_ops
"""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.accelerator import get_accelerator  # noqa: E402

from megatron_ds.data import index_helpers  # noqa: E402

OPS = ("CPUAdamBuilder",        # --cpu-optimizer
       "ShareMemCommBuilder")   # TP all-reduces when TP is the world on one host (launch/runtime.py)


def main():
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
    index_helpers.compiled_helpers()


if __name__ == "__main__":
    main()
