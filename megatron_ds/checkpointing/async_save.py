"""The checkpoint engines DeepSpeed writes every checkpoint file through (`checkpoint_engine.save(state_dict,
path)`): FileWriter for a save in the training thread, BackgroundWriter for --async-save. Both fsync each file
and keep the first write that fails (an OSError naming the file) for their wait() to raise, writing nothing more
of that save, so every rank still meets DeepSpeed's collectives and the ranks can agree to abandon the save.
Both keep each file's checksum, computed while writing it, until the save takes them for the metadata.

--async-save (Megatron's name): a checkpoint is written in the background while training goes on.
BackgroundWriter's save() copies the state dict's tensors (so training may change the originals at once) and
queues the copy; one thread per rank writes the queued files in order, fsyncs each, and runs the jobs queued
after them (the finishing of the checkpoint). The crash-safety of a save is unchanged: everything goes to the
temporary folder, each rank leaves a marker there once its files are on disk (holding their checksums; or a
failure marker once a write of it failed), and rank 0's thread waits for every marker, then writes the metadata
last and publishes the folder and the pointers (files.publish). A save that is killed leaves the previous
checkpoint published.
"""
import json
import os
import queue
import threading
import time

import torch
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from megatron_ds.checkpointing import files

MARKER_PREFIX = ".written_by_rank_"
FAILURE_PREFIX = ".failed_by_rank_"


def marker_name(rank, prefix=MARKER_PREFIX):
    return f"{prefix}{rank:05d}"


class _ChecksummingWriter(TorchCheckpointEngine):
    """What both writers share: the checksum of each file written, kept until take_checksums()."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self._checksums = {}

    def _write(self, state_dict, path):
        self._checksums[os.path.abspath(path)] = files.write_torch_file(state_dict, path)

    def take_checksums(self, folder):
        """{name relative to folder: checksum} of the files written into folder; forgets every checksum kept (those
        of an abandoned save too)."""
        folder = os.path.abspath(folder)
        taken, self._checksums = self._checksums, {}
        return {os.path.relpath(path, folder): checksum for path, checksum in taken.items()
                if path.startswith(folder + os.sep)}


class FileWriter(_ChecksummingWriter):
    """DeepSpeed's checkpoint engine for a save in the training thread."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = "megatron_ds FileWriter"
        self._error = None

    def save(self, state_dict, path: str):
        if self._error is None:
            try:
                self._write(state_dict, path)
            except OSError as error:
                self._error = error

    def wait(self):
        """Raises the first failed write since the last wait()."""
        error, self._error = self._error, None
        if error is not None:
            raise error


class BackgroundWriter(_ChecksummingWriter):
    """DeepSpeed's checkpoint engine with the writing moved to a thread. Errors of the thread are raised by the
    next wait() (every save starts with one); take_checksums() belongs on the thread too (a job queued last)."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = "megatron_ds BackgroundWriter"
        self._jobs = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="megatron_ds async save", daemon=True)
        self._thread.start()

    def save(self, state_dict, path: str):
        copy = clone_tensors_for_torch_save(state_dict, device=torch.device("cpu"))
        self.run_later(lambda: self._write(copy, path))

    def run_later(self, job):
        """Run job() on the writer thread after everything queued before it, unless one of those failed."""
        self._jobs.put((job, False))

    def run_after_all(self, job):
        """Run job(failed) on the writer thread after everything queued before it; failed: whether one of those
        raised."""
        self._jobs.put((job, True))

    def wait(self):
        """Until every queued job has run; raises what a job raised."""
        self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self):
        while True:
            job, after_all = self._jobs.get()
            try:
                if after_all:
                    job(self._error is not None)
                elif self._error is None:  # after a failure nothing more is written: the save stays unpublished
                    job()
            except BaseException as error:  # reported by wait() in the training thread
                self._error = self._error or error
            finally:
                self._jobs.task_done()


def mark_finished(writer, folder, rank, failed):
    """Queued on the writer after this rank's files of the checkpoint in `folder` (run_after_all): its marker with
    the files' checksums, or (failed) its failure marker."""
    if failed:
        mark_failed(folder, rank)
    else:
        mark_written(folder, rank, writer.take_checksums(folder))


def mark_written(folder, rank, checksums):
    """This rank's files of the checkpoint in `folder` are on disk: a marker holding their checksums ({name:
    checksum}) for rank 0, written whole or not at all (rank 0 reads it as soon as it exists). A marker that cannot
    be written leaves a failure marker instead, so rank 0 does not wait for it."""
    try:
        files.atomic_write_text(os.path.join(folder, marker_name(rank)), json.dumps(checksums))
    except OSError:
        mark_failed(folder, rank)
        raise


def mark_failed(folder, rank):
    """This rank's files of the checkpoint in `folder` will not be on disk: an empty file, which a full disk still
    takes."""
    path = os.path.join(folder, marker_name(rank, FAILURE_PREFIX))
    with files.naming_file(path), open(path, "w") as handle:
        handle.flush()
        os.fsync(handle.fileno())


def wait_for_every_rank(folder, world_size, timeout):
    """Wait (polling the folder) until every rank marked its files written, then remove the markers and return
    the checksums they hold ({name: checksum}); None as soon as a rank marks a failure (it reports its error
    itself). Raises TimeoutError naming the ranks missing."""
    names = [marker_name(rank) for rank in range(world_size)]
    failures = [os.path.join(folder, marker_name(rank, FAILURE_PREFIX)) for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    while True:
        if any(os.path.exists(path) for path in failures):
            return None
        missing = [name for name in names if not os.path.exists(os.path.join(folder, name))]
        if not missing:
            break
        if time.monotonic() > deadline:
            ranks = [int(name[len(MARKER_PREFIX):]) for name in missing]
            raise TimeoutError(f"--async-save: ranks {ranks} did not finish writing {folder} within {timeout:.0f} s")
        time.sleep(0.05)
    checksums = {}
    for name in names:
        with open(os.path.join(folder, name)) as marker:
            checksums.update(json.load(marker))
        os.remove(os.path.join(folder, name))
    return checksums
