"""Run a test function on N real processes joined by a gloo process group (forked, one thread each)."""
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ds.launch.runtime import free_port


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(*args)
        dist.barrier()  # rank 0 hosts the store: it must outlive the others' collectives
    except BaseException:  # report any failure, including assertion errors, to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # flush the message before the hard exit
        os._exit(1)
    finally:
        from megatron_ds.core import parallel_state
        parallel_state.destroy_model_parallel()
    os._exit(0)


def run_distributed(fn, world_size, *args, timeout=180):
    """Call fn(*args) on world_size forked ranks; raise with every failing rank's traceback.
    fn reads its rank from torch.distributed."""
    context = mp.get_context("fork")
    errors = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, world_size, port, fn, args, errors))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if hung:
        messages.append(f"ranks {hung} did not finish within {timeout} s")
    if messages or any(process.exitcode for process in processes):
        raise AssertionError("\n".join(messages) or f"exit codes {[p.exitcode for p in processes]}")
