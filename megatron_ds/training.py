"""pretrain(): parse and validate, build the 3D-parallel model inside a DeepSpeed engine, train, evaluate, log.

PP > 1: the model is a DeepSpeed PipelineModule (1F1B schedule) over our topology, and `train_batch`
runs a whole global batch. PP = 1: the plain DeepSpeed engine runs GPTModel with our mpu (so ZeRO-2/3
also work), and this loop runs the micro-batches.
"""
import copy
import json
import logging
import sys
import time

import deepspeed
import torch
import torch.distributed as dist

from megatron_ds.batch_schedule import build_batch_schedule
from megatron_ds.arguments import ArgumentsError, parse_args, transformer_config_from_args
from megatron_ds.checkpointing import CheckpointError, CheckpointManager, TrainingProgress
from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import GPTModel, build_loss_fn, gpt_layer_specs, model_flops_per_iteration
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer.fused_ops import describe_fused_ops
from megatron_ds.core.transformer.transformer_layer import TransformerLayer, assign_recompute_chunks
from megatron_ds.data.builder import batch_iterator, build_datasets, has_validation_data
from megatron_ds.glue.gradient_reduction import install_flat_gradient_reduction
from megatron_ds.glue.mpu import ModelParallelUnit
from megatron_ds.glue.runtime import device, init_distributed, local_world_size
from megatron_ds.glue.topology import describe_ranks, tensor_parallel_placement_warning
from megatron_ds.glue.watchdog import Watchdog
from megatron_ds.optimizer import build_optimizer, optimizer_description
from megatron_ds.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_ds.profiling import IterationProfiler
from megatron_ds.throughput import peak_tflops_per_device


def print_rank_0(message):
    if dist.get_rank() == 0:
        print(message, flush=True)


def is_logging_rank():
    """The first rank of the last pipeline stage: it holds the loss."""
    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def build_model(args, config):
    tied = not args.untie_embeddings_and_output_weights
    if args.pipeline_model_parallel_size == 1:
        return GPTModel(config, args.padded_vocab_size, args.max_position_embeddings, tied)
    specs = gpt_layer_specs(config, args.padded_vocab_size, args.max_position_embeddings, tied)
    with torch.no_grad():  # DeepSpeed broadcasts tied weights in place at construction; keep it out of autograd
        model = deepspeed.pipe.PipelineModule(layers=specs, topology=parallel_state.get_topology(),
                                              loss_fn=build_loss_fn(config), partition_method="type:TransformerLayer")
    assign_recompute_chunks([m for m in model.modules() if isinstance(m, TransformerLayer)], config)
    return model


def build_optimizer_and_scheduler(args, model):
    optimizer = build_optimizer(model, args, device().type)
    scheduler = OptimizerParamScheduler(optimizer, args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                                        args.lr_decay_style)
    return optimizer, scheduler


def setup_engine(args, config):
    model = build_model(args, config).to(device())
    optimizer, scheduler = build_optimizer_and_scheduler(args, model)
    pipelined = args.pipeline_model_parallel_size > 1
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=copy.deepcopy(args.effective_deepspeed_config),  # DeepSpeed may edit it
                                           mpu=None if pipelined else ModelParallelUnit(),
                                           dist_init_required=False)
    if pipelined:
        parallel_state.assert_matches_deepspeed_grid(engine.grid)
    install_flat_gradient_reduction(engine, parallel_state.get_data_parallel_group())
    return engine


def _mean_over_data_parallel(value):
    value = value.detach().float().clone()
    dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value / parallel_state.get_data_parallel_world_size()


def run_global_batch(engine, iterator, accumulation_steps, train):
    """One global batch; returns its mean loss over all micro-batches and data-parallel ranks."""
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


def evaluate(args, engine, iterator, accumulation_steps):
    engine.eval()
    losses = [run_global_batch(engine, iterator, accumulation_steps, train=False) for _ in range(args.eval_iters)]
    engine.train()
    return sum(losses) / len(losses)


class MetricsLogger:
    """Megatron's iteration line on the logging rank, plus TensorBoard scalars."""

    def __init__(self, args, config, peak_tflops):
        self.args = args
        self.flops_per_sample = model_flops_per_iteration(config, args.padded_vocab_size, 1, args.seq_length)
        self.peak_tflops = peak_tflops
        self.writer = None
        if args.tensorboard_dir and is_logging_rank():
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=args.tensorboard_dir)
        self.losses, self.samples, self.interval_start = [], 0, time.perf_counter()

    def iteration(self, iteration, loss, lr, engine, batch_size, consumed_samples):
        self.losses.append(loss)
        self.samples += batch_size
        if iteration % self.args.log_interval:
            return
        args = self.args
        seconds = (time.perf_counter() - self.interval_start) / len(self.losses)
        samples_per_second = self.samples / len(self.losses) / seconds
        tflops = self.flops_per_sample * samples_per_second / args.world_size / 1e12
        scalars = {"lm loss": sum(self.losses) / len(self.losses), "learning-rate": lr,
                   "batch-size": batch_size, "consumed-samples": consumed_samples,
                   "loss-scale": _loss_scale(engine),
                   "grad-norm": engine.get_global_grad_norm(),
                   "tokens-per-second": samples_per_second * args.seq_length,
                   "tflops-per-device": tflops, "mfu": tflops / self.peak_tflops}
        if is_logging_rank():
            print(self._line(iteration, seconds, scalars, engine), flush=True)
            self._write(scalars, iteration)
        self.losses, self.samples, self.interval_start = [], 0, time.perf_counter()

    def _line(self, iteration, seconds, s, engine):
        args = self.args
        grad_norm = "nan" if s["grad-norm"] is None else f"{float(s['grad-norm']):.3f}"
        skipped = f" number of skipped iterations: {engine.skipped_steps} |" if args.fp16 else ""
        return (f" iteration {iteration}/{args.train_iters} | consumed samples: {s['consumed-samples']} |"
                f" elapsed time per iteration (ms): {seconds * 1000:.1f} | learning rate: {s['learning-rate']:.6E} |"
                f" global batch size: {s['batch-size']} | lm loss: {s['lm loss']:.6E} |"
                f" loss scale: {s['loss-scale']:.1f} | grad norm: {grad_norm} |{skipped}"
                f" tokens per second: {s['tokens-per-second']:.1f} | TFLOP/s per device: {s['tflops-per-device']:.3f} |"
                f" MFU: {100 * s['mfu']:.1f}% |")

    def validation(self, iteration, loss):
        if is_logging_rank():
            print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |", flush=True)
            self._write({"validation lm loss": loss}, iteration)

    def _write(self, scalars, iteration):
        if self.writer is None:
            return
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, float(value), iteration)
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()


def _loss_scale(engine):
    if not engine.fp16_enabled():
        return 1.0
    optimizer = engine.optimizer
    return float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0)))


def train(args, engine, datasets, logger, progress=None, checkpoints=None, watchdog=None):
    """Iterations progress.iteration + 1 .. --train-iters from the data positions in progress; checkpoints
    (a CheckpointManager) saves at intervals, on a signal and at the end, and may stop the loop early."""
    progress = progress or TrainingProgress()
    batch_schedule = build_batch_schedule(args)
    train_iterator = batch_iterator(datasets.get("train"), args, progress.consumed_train_samples, device())
    valid_iterator = batch_iterator(datasets.get("valid"), args, progress.consumed_valid_samples, device())
    evaluating = args.eval_interval and args.eval_iters and has_validation_data(args)
    profiler = IterationProfiler(args, dist.get_rank())
    engine.train()
    if checkpoints is not None:
        checkpoints.restore_rng()  # last thing before the first iteration, so a resume repeats the saved run
    for iteration in range(progress.iteration + 1, args.train_iters + 1):
        if watchdog is not None:
            watchdog.activity = f"iteration {iteration}"
        batch_size = batch_schedule.global_batch_size(progress.consumed_train_samples)
        if batch_size != engine.train_batch_size():
            engine.set_train_batch_size(batch_size)  # ramp-up: more micro-batches, same micro-batch size
        accumulation_steps = engine.gradient_accumulation_steps()
        lr = engine.optimizer.param_groups[0]["lr"]
        profiler.begin(iteration)
        loss = run_global_batch(engine, train_iterator, accumulation_steps, train=True)
        profiler.end(iteration)
        progress.iteration = iteration
        progress.consumed_train_samples += batch_size
        logger.iteration(iteration, loss, lr, engine, batch_size, progress.consumed_train_samples)
        if evaluating and iteration % args.eval_interval == 0:
            logger.validation(iteration, evaluate(args, engine, valid_iterator, accumulation_steps))
            progress.consumed_valid_samples += args.eval_iters * batch_size
        if checkpoints is not None and checkpoints.after_iteration(progress):
            return progress
    if checkpoints is not None:
        checkpoints.finish(progress)
    return progress


def log_startup(args, config, engine, peak, peak_source):
    print_rank_0(f"megatron_ds: world size {args.world_size} = TP {args.tensor_model_parallel_size} x PP "
                 f"{args.pipeline_model_parallel_size} x DP {args.data_parallel_size}; global batch "
                 f"{args.global_batch_size} = micro batch {args.micro_batch_size} x DP {args.data_parallel_size} x "
                 f"gradient accumulation {engine.gradient_accumulation_steps()}; padded vocab "
                 f"{args.padded_vocab_size}; dtype {str(args.params_dtype).replace('torch.', '')}; "
                 f"ZeRO stage {args.zero_stage}")
    for axis, groups in parallel_state.all_groups_by_axis().items():
        print_rank_0(f"megatron_ds: {axis}-parallel groups: {groups}")
    _log_parameters_per_stage(engine)
    print_rank_0(f"megatron_ds: effective DeepSpeed config: {json.dumps(args.effective_deepspeed_config, sort_keys=True)}")
    print_rank_0(f"megatron_ds: MFU peak per device: {peak:.3f} TFLOP/s ({peak_source})")
    print_rank_0(f"megatron_ds: fused ops (--fusion-backend {args.fusion_backend}): "
                 f"{describe_fused_ops(config)} "
                 f"optimizer={optimizer_description(args, device().type)}")


def _log_parameters_per_stage(engine):
    local = sum(p.numel() for p in engine.module.parameters())
    entry = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank(), local)
    entries = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    per_stage = {}
    for stage, data_rank, count in entries:
        if data_rank == 0:
            per_stage[stage] = per_stage.get(stage, 0) + count
    for stage in sorted(per_stage):
        print_rank_0(f"megatron_ds: parameters on pipeline stage {stage} (all TP ranks): {per_stage[stage]:,}")


def _configure_logging():
    """megatron_ds's own log records (dataset index building, fallbacks) on stdout; INFO on rank 0 only."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"megatron_ds [rank {dist.get_rank()}]: %(message)s"))
    package_logger = logging.getLogger("megatron_ds")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    package_logger.propagate = False


def pretrain(argv=None):
    try:
        args = parse_args(argv)
    except ArgumentsError as error:
        print(f"megatron_ds: error: {error}", file=sys.stderr, flush=True)
        return 2
    init_distributed(args.distributed_backend, args.distributed_timeout_minutes, args.distributed_port)
    watchdog = Watchdog(dist.get_rank(), dist.get_world_size()).start()
    try:
        status = _pretrain(args, watchdog)
    except BaseException as error:
        watchdog.report_failure(error)  # the other ranks stop within seconds instead of hanging
        raise
    watchdog.stop()  # before the last barrier: after it, rank 0 (the store's host) may be gone
    dist.barrier()
    if status == 0:
        print_rank_0("megatron_ds: training done")
    return status


def _pretrain(args, watchdog):
    _configure_logging()
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    _log_placement(args)
    model_parallel_cuda_manual_seed(args.seed)
    config = transformer_config_from_args(args)
    watchdog.activity = "building the model and the DeepSpeed engine"
    engine = setup_engine(args, config)
    peak, peak_source = peak_tflops_per_device(args.peak_tflops, args.params_dtype, device())
    log_startup(args, config, engine, peak, peak_source)
    watchdog.activity = "building the datasets"
    datasets = build_datasets(args)
    logger = MetricsLogger(args, config, peak)
    checkpoints = CheckpointManager(args, engine, args.effective_deepspeed_config)
    watchdog.activity = "loading the checkpoint"
    try:
        progress = checkpoints.load()
    except CheckpointError as error:
        print(f"megatron_ds: error: {error}", file=sys.stderr, flush=True)
        return 2
    train(args, engine, datasets, logger, progress, checkpoints, watchdog)
    logger.close()
    return 0


def _log_placement(args):
    warning = tensor_parallel_placement_warning(args.tensor_model_parallel_size, local_world_size())
    for text in args.warnings + ((warning,) if warning else ()):
        print_rank_0(f"megatron_ds: WARNING: {text}")
    lines = describe_ranks() if args.print_topology else []
    for line in lines:
        print_rank_0(f"megatron_ds: {line}")
