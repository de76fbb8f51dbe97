"""DeepSpeed's shared-memory all-reduce on CPUs: the level its build supports, its segment, its build skipped.
"""
import os
from pathlib import Path


def shared_memory_all_reduce_level():
    """The vector kernel level of deepspeed.comm's shared-memory all-reduce op (0: none, 1: fp32, 2: also bf16 and
    fp16), read off comm.cdb, the current backend, and its shm_comm_op, shm_vector_kernel_level (0.19.8)."""
    import deepspeed.comm
    backend = deepspeed.comm.comm.cdb
    return 0 if backend.shm_comm_op is None else backend.shm_vector_kernel_level


def unlink_shared_memory_segment():
    """Remove this rank's file of deepspeed.comm's shared-memory all-reduce from /dev/shm. DeepSpeed never removes
    it (0.19.8: shm.cpp names it deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, 69 MB, and
    has no shm_unlink outside an error path): every launch left 69 MB per rank in RAM-backed /dev/shm until the
    host ran out of memory. Call it once every rank has mapped every other's segment (a barrier after
    init_distributed): the mappings outlive the name."""
    import deepspeed.comm
    if deepspeed.comm.comm.cdb.shm_comm_op is None:
        return
    name = "_".join(["deepspeed_allreduce_buffer", str(os.getuid()), os.environ.get("MASTER_ADDR", ""),
                     os.environ.get("MASTER_PORT", ""), str(deepspeed.comm.get_rank())])
    Path("/dev/shm", name).unlink(missing_ok=True)


def skip_shared_memory_comm_build():
    """Mark the shared-memory comm op incompatible in deepspeed.ops.__compatible_ops__, so that
    init_distributed does not JIT-build it (0.19.8)."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
