"""pretrain(): parse and validate, build the 3D-parallel model inside a DeepSpeed engine, train, evaluate, log.

PP > 1: the model is a DeepSpeed PipelineModule (1F1B schedule) over our topology, and `train_batch`
runs a whole global batch. PP = 1: the plain DeepSpeed engine runs GPTModel with our mpu (so ZeRO-2/3
also work), and this loop runs the micro-batches.
"""
import contextlib
import copy
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.checkpointing import CheckpointError, CheckpointManager, TrainingProgress, folder_lock
from megatron_ds.checkpointing.files import CheckpointSaveError
from megatron_ds.compile_watch import CompileWatch
from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.models.gpt import GPTModel, build_loss_fn, gpt_layer_specs
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer.fused_ops import compiled_ops, describe_fused_ops
from megatron_ds.core.transformer.moe import auxiliary_loss_of, begin_global_batch, moe_layers
from megatron_ds.core.transformer.transformer_layer import TransformerLayer, assign_recompute_chunks
from megatron_ds.data.builder import batch_iterator, build_datasets, data_problems, describe_samples, will_evaluate
from megatron_ds.distillation import DistillationLoss, attach_teacher, distillation_loss_of
from megatron_ds.glue.activation_checkpointing import configure_activation_checkpointing
from megatron_ds.glue.cpu_features import sixteen_bit_warning_here
from megatron_ds.glue.curriculum import SequenceLengthCurriculum
from megatron_ds.glue.ds_config import deepspeed_train_batch_size
from megatron_ds.glue.gradient_reduction import install_flat_gradient_reduction
from megatron_ds.glue.launcher_env import Attempt, read_attempt
from megatron_ds.glue.moe_token_gather import mend_token_split
from megatron_ds.glue.mpu import ModelParallelUnit
from megatron_ds.glue.pipeline_schedules import install_schedule, pipeline_module_class
from megatron_ds.glue.runtime import (
    deepspeed_device_arguments,
    device,
    init_distributed,
    local_rank_naming_the_device,
    local_world_size,
    print_rank_0,
)
from megatron_ds.glue.storage import storage_problems
from megatron_ds.glue.topology import describe_ranks, tensor_parallel_placement_warning
from megatron_ds.glue.watchdog import Watchdog
from megatron_ds.iteration_plan import plan_iteration
from megatron_ds.metrics import MetricsLogger, is_logging_rank, logging_rank, loss_scale
from megatron_ds.optimizer import build_optimizer, optimizer_description
from megatron_ds.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_ds.pipeline_timeline import pipeline_timeline
from megatron_ds.planning.cli import model_spec, predicted_stage_memory
from megatron_ds.planning.memory import checkpoint_bytes
from megatron_ds.planning.parameters import active_parameters, total_parameters
from megatron_ds.profiling import IterationProfiler
from megatron_ds.rerun import ReproducibilityStats, RerunExit, ResultValidator, Validation
from megatron_ds.stragglers import StragglerDetector
from megatron_ds.throughput import peak_tflops_per_device


def build_model(args, config):
    tied = not args.untie_embeddings_and_output_weights
    loss_fn = build_loss_fn(config)
    if args.distillation is not None:
        loss_fn = DistillationLoss(loss_fn, args.distillation)
    if args.pipeline_model_parallel_size == 1:
        model = GPTModel(config, args.padded_vocab_size, args.max_position_embeddings, tied)
        model.loss_fn = loss_fn
        return model
    specs = gpt_layer_specs(config, args.padded_vocab_size, args.max_position_embeddings, tied)
    with torch.no_grad():  # DeepSpeed broadcasts tied weights in place at construction; keep it out of autograd
        module_class = pipeline_module_class(args.pipeline_schedule, args.virtual_pipeline_stages)
        model = module_class(layers=specs, topology=parallel_state.deepspeed_topology(),
                             loss_fn=loss_fn, partition_method="type:TransformerLayer")
    assign_recompute_chunks([m for m in model.modules() if isinstance(m, TransformerLayer)], config)
    return model


def build_optimizer_and_scheduler(optimization, model):
    optimizer = build_optimizer(model, optimization, device().type)
    scheduler = OptimizerParamScheduler(optimizer, optimization.lr_schedule, optimization.seq_length,
                                        optimization.batch_schedule)
    return optimizer, scheduler


def setup_engine(args, config, building_model=contextlib.nullcontext):
    with building_model(), local_rank_naming_the_device():
        model = build_model(args, config)
    model = model.to(device())
    optimizer, scheduler = build_optimizer_and_scheduler(args.optimization, model)
    pipelined = args.pipeline_model_parallel_size > 1
    engine, _, _, _ = deepspeed.initialize(args=deepspeed_device_arguments(), model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler,
                                           config=copy.deepcopy(args.effective_deepspeed_config),  # it may edit it
                                           mpu=None if pipelined else ModelParallelUnit(),
                                           dist_init_required=False)
    deepspeed_internals.mend_zero_stage_0(engine)
    deepspeed_internals.zero_bf16_fp32_gradients_once(engine.optimizer)
    if pipelined:
        parallel_state.assert_matches_deepspeed_grid(engine.grid)
        install_schedule(engine, args.pipeline_schedule, args.virtual_pipeline_stages)
    else:
        parallel_state.assert_matches_deepspeed_engine(engine)
    install_flat_gradient_reduction(engine, parallel_state.get_sequence_data_parallel_group())
    return engine


def _mean_over_data_parallel(value):
    """The mean over the ranks holding the same weights (SP x DP: each Ulysses rank's loss is its share of the
    sample's, times SP; core/models/gpt/gpt_model.py)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=parallel_state.get_sequence_data_parallel_group())
    return value / parallel_state.get_sequence_data_parallel_world_size()


def run_global_batch(engine, iterator, accumulation_steps, train, experts=None):
    """One global batch; returns (lm loss, {"moe loss": MoE auxiliary loss, "kd loss": the distillation term}
    (those the run has)), each the mean over all micro-batches and data-parallel ranks. experts: this rank's MoE
    layers (moe_layers(engine.module), possibly none on this stage) when the model is an MoE and its auxiliary
    loss is wanted, else None."""
    if experts is not None:
        # the auxiliary loss's gradient is started inside the MoE layers: scaled as DeepSpeed scales the loss's
        begin_global_batch(experts, loss_scale(engine) / accumulation_steps)
    distillation = distillation_loss_of(engine.module) if train else None
    if distillation is not None:
        distillation.begin_global_batch()
    loss = _run_micro_batches(engine, iterator, accumulation_steps, train)
    others = {} if experts is None else {"moe loss": _moe_loss(experts)}
    if distillation is not None:  # the engine's loss is the weighted sum: the line reports the two terms
        loss, others["kd loss"] = _mean_over_data_parallel(distillation.global_batch_losses(device())).tolist()
    return loss, others


def _run_micro_batches(engine, iterator, accumulation_steps, train):
    """The loss the engine computes (the model's loss_fn), the mean over the micro-batches and data parallel."""
    if isinstance(engine, deepspeed.PipelineEngine):
        loss = engine.train_batch(data_iter=iterator) if train else engine.eval_batch(data_iter=iterator)
        return loss.item()
    total = torch.zeros((), device=device())
    for _ in range(accumulation_steps):
        inputs, labels = next(iterator)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)  # GPTModel(input_ids, position_ids, mask)
        if train:
            loss = engine(*inputs, labels=labels)
            engine.backward(loss)
            engine.step()
        else:
            with torch.no_grad():
                loss = engine(*inputs, labels=labels)
        total += loss.detach()
    return _mean_over_data_parallel(total / accumulation_steps).item()


def _moe_loss(experts):
    """The MoE auxiliary loss of the global batch: this stage's layers' (each the mean over micro-batches),
    summed over the pipeline stages, mean over the data-parallel ranks."""
    local = auxiliary_loss_of(experts).to(device())
    dist.all_reduce(local, group=parallel_state.get_pipeline_model_parallel_group())
    return _mean_over_data_parallel(local).item()


def evaluate(args, engine, iterator, accumulation_steps, curriculum=None):
    """The mean loss of --eval-iters global batches, at the full --seq-length."""
    if curriculum is not None:
        _change_sequence_length(engine, curriculum.length, args.seq_length)
    engine.eval()
    _renew_pipeline_buffers(args, engine)
    losses = [run_global_batch(engine, iterator, accumulation_steps, train=False)[0] for _ in range(args.eval_iters)]
    engine.train()
    _renew_pipeline_buffers(args, engine)
    if curriculum is not None:
        _change_sequence_length(engine, args.seq_length, curriculum.length)
    return sum(losses) / len(losses)


def _renew_pipeline_buffers(args, engine):
    """--kd: the stages hand on the teacher's hidden states in training only, so the pipeline's buffers change."""
    if args.distillation is not None and isinstance(engine, deepspeed.PipelineEngine):
        engine.reset_activation_shape()


def _change_sequence_length(engine, old, new):
    """DeepSpeed's pipeline engine keeps its send/receive buffers from the first batch: renew them when the
    sequence length changes (Megatron-DeepSpeed does the same for its curriculum)."""
    if old != new and isinstance(engine, deepspeed.PipelineEngine):
        engine.reset_activation_shape()


def train(args, engine, datasets, logger, progress=None, checkpoints=None, watchdog=None):
    """Iterations progress.iteration + 1 .. --train-iters from the data positions in progress, stopping early
    once --train-tokens are consumed; checkpoints (a CheckpointManager) saves at intervals, on a signal and
    at the end, and may stop the loop early."""
    progress = progress or TrainingProgress()
    curriculum = (SequenceLengthCurriculum(args.curriculum_learning_legacy, args.seq_length)
                  if args.curriculum_learning_legacy else None)
    train_data = _TrainData(datasets.get("train"), args.data, curriculum)
    train_data.start_at(progress.consumed_train_samples)
    valid_iterator = batch_iterator(datasets.get("valid"), args.data, progress.consumed_valid_samples, device())
    evaluating = will_evaluate(args.data)
    experts = moe_layers(engine.module) if args.moe else None
    skipped = ConsecutiveSkips(args.max_consecutive_skipped_steps)
    profiler = IterationProfiler(args.logging, dist.get_rank())
    timeline = pipeline_timeline(args, engine, progress.iteration + 1)
    compile_watch = CompileWatch(bool(compiled_ops(args.model)))
    stragglers = _straggler_detector(args.logging)
    validator = _result_validator(args, engine)
    engine.train()
    if checkpoints is not None:
        checkpoints.restore_rng()  # last thing before the first iteration, so a resume repeats the saved run
    for iteration in range(progress.iteration + 1, args.train_iters + 1):
        if _train_tokens_reached(args, progress):
            break
        if watchdog is not None:
            watchdog.activity = f"iteration {iteration}"
        plan = plan_iteration(iteration, progress, args.optimization.batch_schedule, args.micro_batch_size,
                              args.data_parallel_size, _sequence_length(engine, curriculum, iteration, args.seq_length),
                              by_curriculum=curriculum is not None)
        begin_iteration(args, engine, plan)
        lr = engine.optimizer.param_groups[0]["lr"]
        profiler.begin(iteration)
        timeline.begin(iteration, plan.micro_batches)
        compile_watch.before_iteration()
        stragglers.begin()
        loss, other_losses = _train_global_batch(engine, train_data, plan, progress, experts, validator,
                                                 iteration)
        stragglers.end()
        compile_line = compile_watch.after_iteration(iteration)
        profiler.end(iteration)
        timeline.end()
        progress.iteration = iteration
        progress.consumed_train_samples += plan.global_batch_size
        progress.consumed_train_tokens += plan.tokens
        grad_norm = _grad_norm_to_check(args, engine)  # before the log line, which then reads the same float
        logger.iteration(plan, loss, lr, engine, progress, other_losses)
        if iteration % args.logging.log_interval == 0:
            stragglers.report(iteration, is_logging_rank(), logger.writers)
            _report_reproducibility(validator, iteration)
        _log_compile(compile_line)
        _stop_on_non_finite(args, iteration, loss, grad_norm, checkpoints)
        _stop_on_skipped_steps(skipped, engine, iteration, checkpoints)
        if evaluating and iteration % args.eval_interval == 0:
            logger.validation(iteration, evaluate(args, engine, valid_iterator, plan.micro_batches, curriculum))
            progress.consumed_valid_samples += args.eval_iters * plan.global_batch_size
        if checkpoints is not None and checkpoints.after_iteration(progress):
            timeline.finish()
            return progress
    timeline.finish()
    _log_compile(compile_watch.summary())
    if progress.iteration % args.logging.log_interval:
        _report_reproducibility(validator, progress.iteration)
    if checkpoints is not None:
        checkpoints.finish(progress)
    return progress


def _result_validator(args, engine):
    """--rerun-mode's validator (megatron_ds/rerun.py), or None when disabled."""
    if args.rerun_mode == "validate_results":
        return ResultValidator(Validation.from_args(args), engine)
    if args.rerun_mode == "report_stats":
        return ReproducibilityStats(Validation.from_args(args), engine, args.rerun_stats_interval)
    return None


def _report_reproducibility(validator, iteration):
    if isinstance(validator, ReproducibilityStats):
        print_rank_0(validator.report(iteration))


class _TrainData:
    """The training micro-batches from a global sample position, which a replay of an iteration (--rerun-mode
    validate_results) sets back to the iteration's first sample."""

    def __init__(self, dataset, data, curriculum):
        self.dataset, self.data, self.curriculum, self.iterator = dataset, data, curriculum, None

    def start_at(self, consumed_samples, replicas_over=0):
        self.iterator = batch_iterator(self.dataset, self.data, consumed_samples, device(), self.curriculum,
                                       replicas_over)

    def describe(self, first, count):
        if self.dataset is None:  # a middle pipeline stage reads no data
            return f"samples {first}-{first + count - 1}"
        return describe_samples(self.dataset, first, count)


def _train_global_batch(engine, train_data, plan, progress, experts, validator, iteration):
    """(lm loss, other losses) of the iteration's global batch (run_global_batch), its optimizer step taken;
    through the validator (megatron_ds/rerun.py) when there is one."""
    def compute():
        return run_global_batch(engine, train_data.iterator, plan.micro_batches, train=True, experts=experts)

    if validator is None:
        return compute()
    batch = _IterationBatch(train_data, progress.consumed_train_samples, plan.global_batch_size)
    loss, other_losses, _ = validator.run_iteration(iteration, compute, batch)
    return loss, other_losses


@dataclass(frozen=True)
class _IterationBatch:
    """The global batch of the iteration being validated, as rerun.py moves the data over it."""
    train_data: _TrainData
    first: int
    size: int

    def rewind(self, replicas_over=0):
        """The data back at the batch's first sample (of the data-parallel rank replicas_over after this one)."""
        self.train_data.start_at(self.first, replicas_over)

    def pass_over(self):
        """The data at the next batch's first sample, this rank's own."""
        self.train_data.start_at(self.first + self.size)

    def describe(self):
        return self.train_data.describe(self.first, self.size)


class _NoStragglerDetector:
    def begin(self):
        pass

    def end(self):
        pass

    def report(self, iteration, printing, writers=None):
        return []


def _straggler_detector(config):
    """--log-straggler's detector (megatron_ds/stragglers.py), else one that does nothing."""
    if not config.log_straggler:
        return _NoStragglerDetector()
    return StragglerDetector(config.straggler_threshold, config.straggler_minmax_count, config.straggler_intervals,
                             parallel_state.get_pipeline_model_parallel_rank(),
                             enabled=not config.disable_straggler_on_startup, switch_port=config.straggler_ctrlr_port)


def begin_iteration(args, engine, plan):
    """Hand the plan to DeepSpeed's engine (the ramp-up changes its batch: more micro-batches of the same size)
    and to the LR scheduler (its step counts the plan's samples and tokens)."""
    if deepspeed_train_batch_size(args, plan.global_batch_size) != engine.train_batch_size():
        engine.set_train_batch_size(deepspeed_train_batch_size(args, plan.global_batch_size))
    engine.lr_scheduler.begin_iteration(plan)


def _log_compile(line):
    if line:
        print_rank_0(line)


class NonFiniteTraining(RuntimeError):
    """The loss or gradient norm of an iteration is NaN or Inf (Megatron's --check-for-nan-in-loss-and-grad)."""


def _checks_non_finite(args):
    return args.check_for_nan_in_loss_and_grad and not args.fp16


def _grad_norm_to_check(args, engine):
    """The gradient norm _stop_on_non_finite checks (None where it checks none)."""
    return deepspeed_internals.host_global_grad_norm(engine) if _checks_non_finite(args) else None


def _stop_on_non_finite(args, iteration, loss, grad_norm, checkpoints):
    """Every rank sees the same loss (averaged over the replicas) and global gradient norm (the float of
    _grad_norm_to_check), so all stop at the same iteration; that iteration is never saved. fp16 is left to
    DeepSpeed's loss scaling, whose skipped steps are normal."""
    if not _checks_non_finite(args):
        return
    values = {"lm loss": loss, "grad norm": grad_norm}
    bad = {name: value for name, value in values.items() if value is not None and not math.isfinite(value)}
    if not bad:
        return
    if checkpoints is not None:
        checkpoints.wait_for_saves()  # an earlier save in the background is finite: let it land
    described = ", ".join(f"{name} {value}" for name, value in bad.items())
    raise NonFiniteTraining(f"iteration {iteration}: {described} on rank {dist.get_rank()}; stopping before any "
                            f"save of it (the last checkpoint, if any, is from before). Lower --lr, check the data, "
                            f"or pass --no-check-for-nan-in-loss-and-grad to train on")


class ConsecutiveSkips:
    """Optimizer steps DeepSpeed skipped in a row (a gradient overflow: fp16's dynamic loss scaling, or ZeRO's
    overflow check when the non-finite guard is off). A few are normal in fp16 while the loss scale settles;
    more than `limit` (0: no limit) means training no longer moves."""

    def __init__(self, limit):
        self.limit, self.count = limit, 0

    def after_step(self, applied):
        """Record one step; whether the limit is now exceeded."""
        self.count = 0 if applied else self.count + 1
        return bool(self.limit) and self.count > self.limit


def _stop_on_skipped_steps(skipped, engine, iteration, checkpoints):
    """Every rank learns the same overflow (DeepSpeed reduces it), so all stop at the same iteration, unsaved."""
    if not skipped.after_step(engine.was_step_applied()):
        return
    if checkpoints is not None:
        checkpoints.wait_for_saves()
    raise NonFiniteTraining(f"iteration {iteration}: DeepSpeed skipped the optimizer step {skipped.count} times in a "
                            f"row (gradient overflow; loss scale {loss_scale(engine):g}), more than "
                            f"--max-consecutive-skipped-steps {skipped.limit}; stopping before any save of it. Lower "
                            f"--lr, check the data, or raise the limit (0: none)")


def _sequence_length(engine, curriculum, iteration, seq_length):
    """This iteration's sequence length: the curriculum's, else --seq-length."""
    if curriculum is None:
        return seq_length
    previous = curriculum.length
    _change_sequence_length(engine, previous, curriculum.advance_to(iteration))
    return curriculum.length


def _train_tokens_reached(args, progress):
    """Megatron-DeepSpeed's --train-tokens: no further iteration once that many tokens are consumed (checked
    before each iteration, as its loop condition). Every rank counts the same batches, so all stop together."""
    if args.train_tokens is None or progress.consumed_train_tokens < args.train_tokens:
        return False
    print_rank_0(f"--train-tokens {args.train_tokens} reached: {progress.consumed_train_tokens} tokens "
                 f"consumed at iteration {progress.iteration}")
    return True


def log_startup(args, config, engine, peak, peak_source):
    sequence = f"SP {args.ds_sequence_parallel_size} x " if args.ds_sequence_parallel_size > 1 else ""
    print_rank_0(f"world size {args.world_size} = TP {args.tensor_model_parallel_size} x {sequence}PP "
                 f"{args.pipeline_model_parallel_size} x DP {args.data_parallel_size}; global batch "
                 f"{args.global_batch_size} = micro batch {args.micro_batch_size} x DP {args.data_parallel_size} x "
                 f"gradient accumulation {engine.gradient_accumulation_steps()}; padded vocab "
                 f"{args.padded_vocab_size}; dtype {str(args.params_dtype).replace('torch.', '')}; "
                 f"ZeRO stage {args.zero_stage}")
    for axis, groups in parallel_state.all_groups_by_axis().items():
        print_rank_0(f"{axis}-parallel groups: {groups}")
    if config.is_moe:
        for axis, groups in parallel_state.expert_groups_by_axis(config.moe_expert_parallel_size,
                                                                 config.moe_expert_tensor_parallel).items():
            print_rank_0(f"{axis}-parallel groups: {groups}")
    _log_parameters_per_stage(engine)
    if config.is_moe:
        _log_experts(args, config)
    print_rank_0(f"effective DeepSpeed config: {json.dumps(args.effective_deepspeed_config, sort_keys=True)}")
    print_rank_0(f"MFU peak per device: {peak:.3f} TFLOP/s ({peak_source})")
    compiled = compiled_ops(config)
    compiling = f"; {len(compiled)} compiled on first use, the cost reported after 2 iterations" if compiled else ""
    print_rank_0(f"fused ops (--fusion-backend {args.fusion_backend}): "
                 f"{describe_fused_ops(config)} "
                 f"optimizer={optimizer_description(args.optimization, device().type)}{compiling}")


def _log_parameters_per_stage(engine):
    local = sum(p.numel() for p in engine.module.parameters())
    entry = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_sequence_data_parallel_rank(),
             local)
    entries = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    per_stage = {}
    for stage, data_rank, count in entries:
        if data_rank == 0:
            per_stage[stage] = per_stage.get(stage, 0) + count
    for stage in sorted(per_stage):
        print_rank_0(f"parameters on pipeline stage {stage} (all TP ranks): {per_stage[stage]:,}")


def _log_experts(args, config):
    """Total and active parameters (the planner's count: the one formula), and the experts' placement."""
    spec = model_spec(args, config)
    counts = sorted({config.experts_in_layer(n) for n in range(1, config.num_layers + 1)} - {1})
    print_rank_0(f"Mixture of Experts: {total_parameters(spec):,} parameters in all, "
                 f"{active_parameters(spec):,} active per token (top-{config.moe_router_topk} of "
                 f"{'/'.join(map(str, counts))} experts every {config.expert_interval} layers); "
                 f"{'/'.join(str(count // config.moe_expert_parallel_size) for count in counts)} experts per "
                 f"rank (EP {config.moe_expert_parallel_size})"
                 + (f", each split over TP {args.tensor_model_parallel_size} (--enable-expert-tensor-parallelism)"
                    if config.moe_expert_tensor_parallel else ""))


def _configure_logging():
    """megatron_ds's own log records (dataset index building, fallbacks) on stdout; INFO on rank 0 only."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"megatron_ds [rank {dist.get_rank()}]: %(message)s"))
    package_logger = logging.getLogger("megatron_ds")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    package_logger.propagate = False


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
    all_reduce_note = init_distributed(args.distributed_backend, args.distributed_timeout_minutes,
                                       args.distributed_port, args.tensor_model_parallel_size)
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
    dist.barrier()
    if status == 0:
        print_rank_0("training done")
    return status


def _refuse(problems):
    """Start-up refusal: each problem on its own line on stderr; exit status 2."""
    for problem in problems:
        print(f"megatron_ds: error: {problem}", file=sys.stderr, flush=True)
    return 2


def _storage_ready(args):
    """Every rank checks the folders it writes (glue/storage.py) and learns every rank's problems, so all stop
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


def initialize_groups(args):
    """The model-parallel groups and, for an MoE, the expert groups (every rank creates all of them, in order)."""
    parallel_state.initialize_model_parallel(topology=parallel_state.topology_of(args.parallel))
    if args.moe:
        parallel_state.initialize_expert_parallel(args.moe_expert_parallel_size, args.enable_expert_tensor_parallelism)
        mend_token_split()


def start_up(args, watchdog=None, all_reduce_note=None, building_model=contextlib.nullcontext):
    """What every rank does once the process group exists, before any data: the model-parallel and expert
    groups, the placement log, DeepSpeed's activation checkpointing, seeding, the model inside its DeepSpeed
    engine (built under `building_model()`) and the start-up log. pretrain() and tools/dry_run.py (the model
    under FakeTensorMode, on a fake process group) both run it. Returns (engine, MFU peak per device)."""
    _configure_logging()
    initialize_groups(args)
    _log_placement(args)
    if all_reduce_note:
        print_rank_0(all_reduce_note)
    configure_activation_checkpointing(args, device())  # DeepSpeed's checkpoint and RNG tracker, if asked for
    model_parallel_cuda_manual_seed(args.seed)
    if watchdog is not None:
        watchdog.activity = "building the model and the DeepSpeed engine"
    engine = setup_engine(args, args.model, building_model)
    peak, peak_source = peak_tflops_per_device(args.peak_tflops, args.params_dtype, device())
    log_startup(args, args.model, engine, peak, peak_source)
    return engine, peak


def _attach_teacher(args, engine, watchdog):
    """--kd: the teacher's share of this rank, read from --load-teacher; each pipeline stage's share said by its
    first TP and data-parallel rank."""
    watchdog.activity = "reading the teacher (--load-teacher)"
    line = attach_teacher(args, engine.module, args.pipeline_model_parallel_size > 1)
    if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_sequence_data_parallel_rank() == 0:
        print(line, flush=True)


def _pretrain(args, watchdog, start_time=None, all_reduce_note=None, attempt=Attempt()):
    _warn_of_16_bit_on_this_cpu(args)
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


def _warn_of_16_bit_on_this_cpu(args):
    """On a CPU, --bf16 / --fp16 without the CPU's matrix unit for it (glue/cpu_features.py) runs its matmuls many
    times slower than fp32 (85x for bf16 on an AVX2-only EPYC): rank 0 says so, with the slowdown it measures (only
    then). Not in start_up(): tools/dry_run.py's ranks train nothing here."""
    if device().type == "cpu" and dist.get_rank() == 0:
        text = sixteen_bit_warning_here(args.params_dtype)
        if text:
            print_rank_0(f"WARNING: {text}")


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


def _log_placement(args):
    warning = tensor_parallel_placement_warning(args.tensor_model_parallel_size, local_world_size())
    for text in args.warnings + ((warning,) if warning else ()):
        print_rank_0(f"WARNING: {text}")
    lines = describe_ranks() if args.print_topology else []
    for line in lines:
        print_rank_0(line)
