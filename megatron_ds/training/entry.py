"""pretrain(): parse and validate, check data and storage on every rank, start up, load, train, exit with a status.

Exit status: 0 done; 1 training stopped itself (non-finite values, a failed save); 2 a refusal at start-up (bad
flags, data, storage, a --save folder in use, a checkpoint that cannot be loaded); --rerun-mode's own codes.
"""
import re
import sys
import time

import torch.distributed as dist

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.checkpointing import CheckpointError, CheckpointManager, folder_lock
from megatron_ds.checkpointing.files import CheckpointSaveError
from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.tensor_parallel.mappings import use_tensor_parallel_all_reduce
from megatron_ds.data.builder import build_datasets, data_problems
from megatron_ds.launch.launcher_env import Attempt, read_attempt
from megatron_ds.launch.runtime import (
    finish_distributed,
    init_distributed,
    print_rank_0,
)
from megatron_ds.launch.storage import storage_problems
from megatron_ds.launch.watchdog import Watchdog
from megatron_ds.observability.metrics import MetricsLogger, logging_rank
from megatron_ds.planning.from_flags import model_spec, predicted_stage_memory
from megatron_ds.planning.memory import checkpoint_bytes
from megatron_ds.training.distillation import attach_teacher
from megatron_ds.training.initialize import start_up, warn_of_16_bit_on_this_cpu
from megatron_ds.training.loop import train
from megatron_ds.training.resilience.rerun import RerunExit
from megatron_ds.training.stopping import NonFiniteTraining


def pretrain(argv=None, start_time=None):
    """start_time: time.time() when the job started (default: now); --exit-duration-in-mins counts from it."""
    start_time = time.time() if start_time is None else start_time
    version_problems = deepspeed_internals.deepspeed_version_errors()  # before anything leans on DeepSpeed
    if version_problems:
        return _refuse(version_problems)
    try:
        args = parse_args(argv)
    except ArgumentsError as error:
        return _refuse([str(error)])
    problems = data_problems(args.data)  # every rank reads the indices itself: no process group to hang
    if problems:
        return _refuse(problems)
    tensor_parallel_all_reduce = init_distributed(args.distributed_backend, args.distributed_timeout_minutes,
                                                  args.distributed_port, args.tensor_model_parallel_size)
    all_reduce_note = None
    if tensor_parallel_all_reduce is not None:
        use_tensor_parallel_all_reduce(tensor_parallel_all_reduce.all_reduce)
        all_reduce_note = tensor_parallel_all_reduce.note
    if not _storage_ready(args) or not _claim_save_folder(args):
        return 2
    attempt = read_attempt()
    watchdog = Watchdog(dist.get_rank(), dist.get_world_size(), attempt=attempt.number).start()
    try:
        status = _pretrain(args, watchdog, start_time, all_reduce_note, attempt)
    except BaseException as error:
        watchdog.report_failure(error)  # the other ranks stop within seconds instead of hanging
        raise
    finally:
        if args.save and dist.get_rank() == 0:
            folder_lock.release(args.save)
    watchdog.stop()  # before the last barrier: after it, rank 0 (the store's host) may be gone
    rank = dist.get_rank()
    finish_distributed()
    if status == 0 and rank == 0:
        print("megatron_ds: training done", flush=True)
    return status


def _refuse(problems):
    """Start-up refusal: each problem on its own line on stderr; exit status 2."""
    for problem in problems:
        print(f"megatron_ds: error: {problem}", file=sys.stderr, flush=True)
    return 2


def _storage_ready(args):
    """Every rank checks the folders it writes (launch/storage.py) and learns every rank's problems, so all stop
    together, before training; returns whether training may go on."""
    topology = parallel_state.topology_of(args.parallel)
    size = checkpoint_bytes(model_spec(args, args.model), args.zero_stage) if args.save else 0
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, storage_problems(args, dist.get_rank(), logging_rank(topology), size))
    problems = list(dict.fromkeys(problem for problems in everyone for problem in problems))
    _refuse(problems)
    return not problems


def _claim_save_folder(args):
    """Rank 0 takes --save's lock (checkpointing/folder_lock.py) and every rank learns the outcome, so a folder in
    use stops all of them at once; returns whether training may go on."""
    if not args.save:
        return True
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [("ok", folder_lock.claim(args.save))]
        except (CheckpointError, OSError) as error:
            outcome = [("error", f"--save {args.save}: {error}" if isinstance(error, OSError) else str(error))]
    dist.broadcast_object_list(outcome, src=0)
    kind, text = outcome[0]
    if kind == "error":
        print(f"megatron_ds: error: {text}", file=sys.stderr, flush=True)
        return False
    if text:
        print_rank_0(f"WARNING: {text}")
    return True


def _pretrain(args, watchdog, start_time=None, all_reduce_note=None, attempt=Attempt()):
    warn_of_16_bit_on_this_cpu(args)
    engine, peak = start_up(args, watchdog, all_reduce_note)
    config = args.model
    watchdog.activity = "building the datasets"
    datasets = build_datasets(args.data)
    logger = MetricsLogger(args.logging, config, peak, engine,
                           predicted_stage_memory(args, config, stage=args.pipeline_model_parallel_size - 1))
    checkpoints = CheckpointManager(args, engine, args.effective_deepspeed_config, start_time)
    watchdog.activity = "loading the checkpoint"
    try:
        if args.distillation is not None:
            _attach_teacher(args, engine, watchdog)
        progress = checkpoints.load()
    except CheckpointError as error:
        print(f"megatron_ds: error: {error}", file=sys.stderr, flush=True)
        return 2
    _announce_restart(attempt, watchdog, progress)
    try:
        train(args, engine, datasets, logger, progress, checkpoints, watchdog)
    except (NonFiniteTraining, CheckpointSaveError) as error:
        print(f"megatron_ds: error: {error}", file=sys.stderr, flush=True)
        logger.close()
        return 1
    except RerunExit as error:
        checkpoints.wait_for_saves()  # a save already under way is of an earlier, validated iteration
        if dist.get_rank() == 0:  # every rank decided the same, on the same values
            print(f"megatron_ds: error: {error}", file=sys.stderr, flush=True)
        logger.close()
        return error.exit_code
    logger.close()
    return 0


def _attach_teacher(args, engine, watchdog):
    """--kd: the teacher's share of this rank, read from --load-teacher; each pipeline stage's share said by its
    first TP and data-parallel rank."""
    watchdog.activity = "reading the teacher (--load-teacher)"
    line = attach_teacher(args, engine.module, args.pipeline_model_parallel_size > 1)
    if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_sequence_data_parallel_rank() == 0:
        print(line, flush=True)


def _announce_restart(attempt, watchdog, progress):
    """A launch started again after a failure says so: which restart, after what (the restarter's reason, else
    the previous launch's failure notice where the store kept it), where it resumes, what is computed again."""
    if not attempt.number:
        return
    reason = attempt.reason or watchdog.previous_failure() or "a failure that left no notice"
    resumed = progress.iteration
    failed = re.search(r"during iteration (\d+)", reason)
    again = ""
    if failed and int(failed.group(1)) > resumed:
        again = (f"; iterations {resumed + 1}-{failed.group(1)} run again "
                 f"({int(failed.group(1)) - resumed} since the last save)")
    print_rank_0(f"restart {attempt.number} of {attempt.max_restarts} ({attempt.by}) after {reason}, resuming from "
                 f"iteration {resumed}{again}")
