"""One run per --save folder: a run takes DIR/.megatron_ds.lock (its host, pid, start time and scheduler job
id) before training, and gives it back at the end. A second run finds the lock and refuses to start, naming
the owner; a lock left by a process that is gone (same host, pid not running) is taken over with a warning.
Two runs writing one folder would interleave their checkpoints under the same names.
"""
import datetime
import json
import os
import socket

from megatron_ds.checkpointing.files import CheckpointError, atomic_write_text

LOCK_FILE = ".megatron_ds.lock"
_JOB_VARIABLES = ("SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "JOB_ID")


def _owner():
    job = next((os.environ[name] for name in _JOB_VARIABLES if os.environ.get(name)), None)
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "job": job}


def _alive(owner):
    """Whether the lock's process may still run: certain only on this host; another host's is assumed alive."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


def _describe(owner):
    job = f", job {owner['job']}" if owner.get("job") else ""
    return f"pid {owner.get('pid')} on host {owner.get('host')} since {owner.get('started')}{job}"


def claim(save_dir):
    """Take the folder's lock for this process; returns a warning when a stale lock was taken over, else None.
    Raises CheckpointError when a live run holds it."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_FILE)
    mine = json.dumps(_owner())
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return _take_over(path, mine)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(mine)
    return None


def _take_over(path, mine):
    try:
        with open(path) as handle:
            owner = json.load(handle)
    except (OSError, ValueError):
        owner = {}
    if owner and _alive(owner):
        raise CheckpointError(f"--save {os.path.dirname(path)} is in use by another run ({_describe(owner)}): two "
                              f"runs would write their checkpoints over each other. Give this run another --save; if "
                              f"that run is gone, delete {path}")
    atomic_write_text(path, mine)
    return f"took over the lock {path} left by a run that is gone ({_describe(owner) if owner else 'unreadable'})"


def release(save_dir):
    """Give the lock back, if this process holds it."""
    path = os.path.join(save_dir, LOCK_FILE)
    try:
        with open(path) as handle:
            owner = json.load(handle)
    except (OSError, ValueError):
        return
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        os.remove(path)
