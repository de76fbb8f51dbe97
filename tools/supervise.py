"""Start a training launch again after a failure, without a person: what torchrun --max-restarts does, for any
launcher (the deepspeed launcher, mpirun, srun).

    python tools/supervise.py --max-restarts 3 -- deepspeed --num_gpus 8 pretrain.py ... --save DIR

The command runs; when it exits with one of --restart-on (default 1, what a failed rank ends the job with, and
16, Megatron-Core's "resume elsewhere") or with a status that says a rank died of a signal (a SIGKILL from the
out-of-memory killer, a segmentation fault: the deepspeed launcher exits with 256 - N for the rank's signal N,
mpirun and shells with 128 + N), it runs again, up to --max-restarts times. pretrain.py resumes each
launch from the last complete checkpoint in --save (no --load needed) and prints which restart it is, after
what, and which iterations it computes again: this tool hands it MEGATRON_DS_RESTART_COUNT,
MEGATRON_DS_MAX_RESTARTS and MEGATRON_DS_RESTART_REASON (the failure notice the ranks printed, else the exit
status). The command's standard output passes through untouched; its standard error is copied line by line
(that is where the notice is read). Exits with the command's last status.
"""
import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ds.launch.launcher_env import MAX_RESTARTS, RESTART_COUNT, RESTART_REASON  # noqa: E402

# a rank's watchdog notice, or pretrain.py's own error line
_NOTICE = re.compile(r"megatron_ds: rank \d+ exiting while in [^:]*: (?P<notice>.+)")
_ERROR = re.compile(r"megatron_ds: error: (?P<notice>.+)")


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="python tools/supervise.py [--max-restarts N] [--restart-on CODE ...] "
                                           "-- COMMAND ...")
    parser.add_argument("--max-restarts", type=int, default=3, help="launches after the first (default 3)")
    parser.add_argument("--restart-on", type=int, nargs="+", default=[1, 16],
                        help="exit statuses that start the command again (default: 1 16)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launch, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run: give it after --, e.g. -- deepspeed --num_gpus 8 pretrain.py ...")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return args, command


def run_once(command, environment):
    """(exit status, the failure notice the launch printed last or None); its stderr copied to ours."""
    notice = None
    with subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True, bufsize=1) as process:
        for line in process.stderr:
            sys.stderr.write(line)
            found = _NOTICE.search(line) or _ERROR.search(line)
            if found and notice is None:  # the first notice names the cause; later ones are its echoes
                notice = found.group("notice").strip()
    return process.returncode, notice


def _died_of_a_signal(status):
    """The launcher itself killed (negative), or reporting a rank's signal N as 128 + N or 256 - N."""
    return status < 0 or 128 < status < 128 + 32 or 256 - 32 < status < 256


def supervise(command, max_restarts, restart_on):
    environment = dict(os.environ)
    restarts = 0
    while True:
        status, notice = run_once(command, environment)
        if status == 0 or not (status in restart_on or _died_of_a_signal(status)):
            return status
        reason = notice or f"the launch exited with status {status}"
        if restarts == max_restarts:
            print(f"supervise: stopping: launch {restarts + 1} failed (status {status}) after {restarts} restart(s), "
                  f"the --max-restarts {max_restarts}: {reason}", file=sys.stderr, flush=True)
            return status
        restarts += 1
        print(f"supervise: launch {restarts} failed (status {status}): {reason}; starting restart {restarts} of "
              f"{max_restarts}", file=sys.stderr, flush=True)
        environment.update({RESTART_COUNT: str(restarts), MAX_RESTARTS: str(max_restarts), RESTART_REASON: reason})


def main(argv=None):
    args, command = parse_arguments(sys.argv[1:] if argv is None else argv)
    return supervise(command, args.max_restarts, args.restart_on)


if __name__ == "__main__":
    sys.exit(main())
