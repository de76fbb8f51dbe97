"""A launcher for the tests that pays pretrain.py's imports once: this process imports torch, DeepSpeed and
megatron_ds (and what their start-up imports lazily: torch's dynamo and inductor, which DeepSpeed's optimizer
check and torch's AdamW pull in, ~4 s a rank here), then forks the ranks of each launch from that state. Each
rank is a real process of its own, as under torchrun: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in its environment, the program (pretrain.py, or -m MODULE ARGS as `torchrun -m`
runs it) run as __main__, stdout and stderr into one log. As torchrun does, when a rank fails the others are
stopped (SIGTERM, then SIGKILL), and the launch exits 1.

    python -m tests.support.zygote        # reads one JSON request a line, answers one JSON line each:
    {"nproc": 4, "program": ["pretrain.py"], "argv": [...], "environ": {...}, "log": "/path", "timeout": 300}
    -> {"returncode": 0, "timed_out": false}

Only this module's request loop runs in the zygote: it never trains, so every rank starts from a process that
has imported but not run anything. tests/support/launch.py uses it for plain pretrain.py launches; launches with their
own environment (sitecustomize hooks, fault injection) or another launcher start real launchers instead.
"""
import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

STOP_GRACE_SECONDS = 5.0


# what a rank's start-up imports, the slow part of its first seconds (DeepSpeed's optimizer check imports its Muon,
# whose torch.compile at import pulls in inductor)
PRELOADED = ("megatron_ds.training", "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer")


def _import_once():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in PRELOADED:
        importlib.import_module(name)


def _exit_code(error):
    if error.code is None or isinstance(error.code, int):
        return error.code or 0
    print(error.code, file=sys.stderr)
    return 1


def _run_rank(rank, request, port):
    """In the forked child: become rank `rank` of the launch and run pretrain.py; never returns."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["environ"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["nproc"]),
                          LOCAL_WORLD_SIZE=str(request["nproc"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        _run_program(request["program"], request["argv"])
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_program(program, argv):
    """program (["pretrain.py"] or ["-m", MODULE, *ARGS]) with argv after it, as __main__."""
    if program[0] == "-m":
        module, *arguments = program[1:]
        sys.argv = [module, *arguments, *argv]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        path, *arguments = program
        sys.argv = [path, *arguments, *argv]
        runpy.run_path(path, run_name="__main__")


def _stop(pids):
    """SIGTERM the ranks still running, SIGKILL those that outlive the grace; reaps them all."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, None)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace or 0)
        while pids and (grace is None or time.monotonic() < deadline):
            pid, _ = os.waitpid(-1, os.WNOHANG if grace else 0)
            if pid:
                pids.discard(pid)
            else:
                time.sleep(0.05)
        if not pids:
            return


def launch(request):
    """Fork the ranks, wait for them; the answer for the request."""
    from tests.support.distributed import free_port
    port = free_port()
    pids = set()
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, request, port)
        pids.add(pid)
    deadline, failed = time.monotonic() + request["timeout"], False
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            if time.monotonic() > deadline:
                _stop(pids)
                return {"returncode": -signal.SIGKILL, "timed_out": True}
            time.sleep(0.05)
            continue
        pids.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed = True
            _stop(pids)
    return {"returncode": 1 if failed else 0, "timed_out": False}


def serve():
    _import_once()
    answers = sys.stdout
    for line in sys.stdin:
        answers.write(json.dumps(launch(json.loads(line))) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
