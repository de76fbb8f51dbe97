"""Start-up checks of the folders a run writes, so that a folder it cannot write, or a --save file system
too full for one checkpoint, stops the run before training instead of at its first save.

Each rank checks the folders it will write itself: every rank writes its checkpoint files to --save and its
trace to --pipeline-timeline, the logging rank writes --tensorboard-dir, rank 0 builds the sample indices in
--data-cache-path.
"""
import os
import shutil
import socket

GIB = 1024 ** 3


def folders_written_by(args, rank, logging_rank):
    """[(flag, folder)] this rank writes to."""
    folders = [("--save", args.save), ("--pipeline-timeline", args.pipeline_timeline),
               ("--tensorboard-dir", args.tensorboard_dir if rank == logging_rank else None),
               ("--data-cache-path", args.data_cache_path if rank == 0 else None)]
    return [(flag, folder) for flag, folder in folders if folder]


def unwritable_problem(flag, folder):
    """None when folder exists (it is created if need be) and this process can write and remove a file in it;
    else the problem, naming the flag, the folder and the OS error."""
    probe = os.path.join(folder, f".megatron_ds_write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            with open(probe, "w") as handle:
                handle.write("megatron_ds checks that it can write here\n")
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            if os.path.lexists(probe):
                os.remove(probe)
    except OSError as error:
        return f"{flag} {folder} is not writable: {error}"
    return None


def free_space_problem(folder, free_bytes, checkpoint_bytes):
    """The problem when the file system of --save `folder`, with free_bytes free, cannot hold one checkpoint of
    checkpoint_bytes (planning.memory.checkpoint_bytes); else None."""
    if free_bytes >= checkpoint_bytes:
        return None
    return (f"--save {folder}: its file system has {_size(free_bytes)} free, but one checkpoint of this model "
            f"takes at least {_size(checkpoint_bytes)}; free space there or give another --save")


def storage_problems(args, rank, logging_rank, checkpoint_bytes):
    """Every problem of the folders this rank writes (see folders_written_by); [] when there is none."""
    problems = []
    for flag, folder in folders_written_by(args, rank, logging_rank):
        problem = unwritable_problem(flag, folder)
        if problem is None and flag == "--save":
            problem = free_space_problem(folder, shutil.disk_usage(folder).free, checkpoint_bytes)
        if problem is not None:
            problems.append(problem)
    return problems


def _size(count):
    return f"{count / GIB:.2f} GiB ({int(count):,} bytes)"
