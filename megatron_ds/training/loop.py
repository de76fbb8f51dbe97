"""The training loop: iterations from the data position of a TrainingProgress, each one global batch through DeepSpeed's
engine, logged, checked for non-finite values and skipped steps, evaluated and checkpointed at their intervals.

PP > 1: the model is a DeepSpeed PipelineModule and `train_batch` runs a whole global batch. PP = 1: the plain
DeepSpeed engine runs GPTModel with our mpu (so ZeRO-2/3 also work), and this loop runs the micro-batches.
"""
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist

from megatron_ds.checkpointing import TrainingProgress
from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel.fp8_delayed import delayed_scalings, update_delayed_scales
from megatron_ds.core.transformer.dropless_moe import (
    dropless_layers,
    stage_token_groups,
    token_split_groups,
    update_expert_bias,
)
from megatron_ds.core.transformer.moe import auxiliary_loss_of, begin_global_batch, moe_layers
from megatron_ds.core.transformer.multi_token_prediction import mtp_loss_of, scheduled_factor
from megatron_ds.data.builder import batch_iterator, describe_samples, will_evaluate
from megatron_ds.engine.curriculum import SequenceLengthCurriculum
from megatron_ds.engine.ds_config import deepspeed_train_batch_size
from megatron_ds.launch.runtime import (
    device,
)
from megatron_ds.observability.metrics import EXPERT_LOAD, EXPERT_LOAD_OF_LAYER, loss_scale
from megatron_ds.training.distillation import distillation_loss_of
from megatron_ds.training.iteration_plan import plan_iteration
from megatron_ds.training.observers import iteration_observers, result_validator
from megatron_ds.training.stopping import (
    ConsecutiveSkips,
    grad_norm_to_check,
    stop_on_non_finite,
    stop_on_skipped_steps,
    train_tokens_reached,
)


def train(args, engine, datasets, logger, progress=None, checkpoints=None, watchdog=None):
    """Iterations progress.iteration + 1 .. --train-iters from the data positions in progress, stopping early
    once --train-tokens are consumed; checkpoints (a CheckpointManager) saves at intervals, on a signal and
    at the end, and may stop the loop early."""
    progress = progress or TrainingProgress()
    data = args.data
    curriculum = (SequenceLengthCurriculum(data.curriculum_learning_legacy, data.seq_length)
                  if data.curriculum_learning_legacy else None)
    train_data = _TrainData(datasets.get("train"), data, curriculum)
    train_data.start_at(progress.consumed_train_samples)
    valid_iterator = batch_iterator(datasets.get("valid"), data, progress.consumed_valid_samples, device())
    evaluating = will_evaluate(data)
    experts = moe_layers(engine.module) if args.model.is_moe else None
    dropless = dropless_layers(engine.module) if args.model.is_dropless_moe else None
    fp8_scalings = delayed_scalings(engine.module)
    skipped = ConsecutiveSkips(args.optimization.max_consecutive_skipped_steps)
    validator = result_validator(args.rerun, engine)
    observers = iteration_observers(args.logging, args.parallel, args.model, engine, progress.iteration + 1,
                                    validator)
    engine.train()
    if checkpoints is not None:
        checkpoints.restore_rng()  # last thing before the first iteration, so a resume repeats the saved run
    for iteration in range(progress.iteration + 1, args.optimization.train_iters + 1):
        if train_tokens_reached(args.optimization.train_tokens, progress):
            break
        if watchdog is not None:
            watchdog.activity = f"iteration {iteration}"
        plan = plan_iteration(iteration, progress, args.optimization.batch_schedule, data.micro_batch_size,
                              args.parallel.data_parallel,
                              _sequence_length(engine, curriculum, iteration, data.seq_length),
                              by_curriculum=curriculum is not None)
        begin_iteration(args.parallel, engine, plan)
        lr = engine.optimizer.param_groups[0]["lr"]
        observers.begin(iteration, plan)
        mtp_factor = scheduled_factor(args.optimization.mtp_loss_scaling_factor,
                                      args.optimization.mtp_loss_scaling_factor_by_tokens,
                                      progress.consumed_train_tokens)
        loss, other_losses = _train_global_batch(engine, train_data, plan, progress, (experts, dropless, mtp_factor),
                                                 validator, iteration)
        if dropless is not None:
            other_losses.update(_balance_experts(dropless, args.model.moe_layer_pattern_with_mtp))
        update_delayed_scales(fp8_scalings, stage_token_groups())
        observers.end(iteration)
        progress.iteration = iteration
        progress.consumed_train_samples += plan.global_batch_size
        progress.consumed_train_tokens += plan.tokens
        grad_norm = grad_norm_to_check(args.optimization, engine)  # before the log line, which reads the same float
        logger.iteration(plan, loss, lr, engine, progress, other_losses)
        observers.logged(iteration, iteration % args.logging.log_interval == 0, logger.writers)
        stop_on_non_finite(args.optimization, iteration, loss, grad_norm, checkpoints)
        stop_on_skipped_steps(skipped, engine, iteration, checkpoints)
        if evaluating and iteration % data.eval_interval == 0:
            logger.validation(iteration, evaluate(data, args.distillation, engine, valid_iterator,
                                                  plan.micro_batches, curriculum))
            progress.consumed_valid_samples += data.eval_iters * plan.global_batch_size
        if checkpoints is not None and checkpoints.after_iteration(progress):
            observers.finish(progress.iteration, stopped_early=True)
            return progress
    observers.finish(progress.iteration)
    if checkpoints is not None:
        checkpoints.finish(progress)
    return progress


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


def _train_global_batch(engine, train_data, plan, progress, other_losses, validator, iteration):
    """(lm loss, other losses) of the iteration's global batch (run_global_batch), its optimizer step taken;
    through the validator (megatron_ds/training/resilience/rerun.py) when there is one. other_losses: this rank's
    (DeepSpeed-MoE layers, dropless MoE layers), each None where the model has none, and the MTP loss's weight."""
    experts, dropless, mtp_factor = other_losses

    def compute():
        return run_global_batch(engine, train_data.iterator, plan.micro_batches, train=True, experts=experts,
                                dropless=dropless, mtp_factor=mtp_factor)

    if validator is None:
        loss, other_losses = compute()
    else:
        batch = _IterationBatch(train_data, progress.consumed_train_samples, plan.global_batch_size)
        loss, other_losses, _ = validator.run_iteration(iteration, compute, batch)
    return loss, other_losses


def _balance_experts(layers, moe_layer_pattern):
    """After the optimizer step: the expert biases of this rank's dropless layers updated from the global batch's
    loads (summed over the ranks of the stage: TP, then sequence- and data-parallel); every MoE layer's max/mean
    load, gathered from the pipeline stages (EXPERT_LOAD_OF_LAYER, by 0-based global layer index: a multi-token
    prediction module's after the model's), and the largest (EXPERT_LOAD)."""
    loads = torch.zeros(len(moe_layer_pattern), device=device())
    if layers:  # a DualPipeV rank may hold none
        loads[[layer.layer_number - 1 for layer in layers]] = update_expert_bias(layers, stage_token_groups()).to(loads)
    dist.all_reduce(loads, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group())
    by_layer = {EXPERT_LOAD_OF_LAYER.format(index): load
                for index, (load, moe) in enumerate(zip(loads.tolist(), moe_layer_pattern)) if moe}
    return {EXPERT_LOAD: max(by_layer.values()), **by_layer}


@dataclass(frozen=True)
class _IterationBatch:
    """The global batch of the iteration being validated, as training/resilience/rerun.py moves the data over it."""
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


def begin_iteration(parallel, engine, plan):
    """Hand the plan to DeepSpeed's engine (the ramp-up changes its batch: more micro-batches of the same size)
    and to the LR scheduler (its step counts the plan's samples and tokens)."""
    batch = deepspeed_train_batch_size(parallel.sequence_split, plan.global_batch_size)
    if batch != engine.train_batch_size():
        engine.set_train_batch_size(batch)
    engine.lr_scheduler.begin_iteration(plan)


def run_global_batch(engine, iterator, accumulation_steps, train, experts=None, dropless=None, mtp_factor=None):
    """One global batch; returns (lm loss, {"moe loss": DeepSpeed-MoE's auxiliary loss, "load balancing loss":
    the dropless layers' balance and z-losses, "mtp loss": the multi-token prediction's (the mean of its depths'),
    "kd loss": the distillation term} (those the run has)), each the mean over all micro-batches and data-parallel
    ranks. experts / dropless: this rank's DeepSpeed-MoE / dropless MoE layers (possibly none on this stage) when
    the model has them and their losses are wanted, else None. mtp_factor: the MTP loss's weight for this batch."""
    # the auxiliary losses' gradients are started inside the MoE layers: scaled as DeepSpeed scales the loss's
    if experts is not None:
        begin_global_batch(experts, loss_scale(engine) / accumulation_steps)
    for layer in dropless or ():
        layer.begin_global_batch(loss_scale(engine) / accumulation_steps)
    distillation = distillation_loss_of(engine.module) if train else None
    if distillation is not None:
        distillation.begin_global_batch()
    mtp = mtp_loss_of(engine.module) if train else None
    if mtp is not None:
        mtp.begin_global_batch(mtp_factor)
    loss = _run_micro_batches(engine, iterator, accumulation_steps, train)
    others = {} if experts is None else {"moe loss": _moe_loss(experts)}
    if dropless is not None:
        others["load balancing loss"] = _moe_loss(dropless, summed_over=token_split_groups())
    if mtp is not None:
        others["mtp loss"] = _last_stage_loss(mtp.global_batch_loss(device()))
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


def _moe_loss(experts, summed_over=()):
    """The MoE auxiliary loss of the global batch: this stage's layers' (each the mean over micro-batches),
    summed over the pipeline stages (and over the groups `summed_over`, whose ranks each hold their share of the
    tokens: TP and Ulysses SP for the dropless layers), mean over the data-parallel ranks."""
    local = auxiliary_loss_of(experts).to(device())
    for group in summed_over:
        dist.all_reduce(local, group=group)
    dist.all_reduce(local, group=parallel_state.get_pipeline_model_parallel_group())
    return _mean_over_data_parallel(local).item()


def _last_stage_loss(local):
    """A loss the last pipeline stage computes (0 on the others), on every rank: the mean over data parallel."""
    local = local.to(device())
    dist.all_reduce(local, group=parallel_state.get_pipeline_model_parallel_group())
    return _mean_over_data_parallel(local).item()


def _mean_over_data_parallel(value):
    """The mean over the ranks holding the same weights (SP x DP: each Ulysses rank's loss is its share of the
    sample's, times SP; core/models/gpt/gpt_model.py)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=parallel_state.get_sequence_data_parallel_group())
    return value / parallel_state.get_sequence_data_parallel_world_size()


def evaluate(data, distillation, engine, iterator, accumulation_steps, curriculum=None):
    """The mean loss of --eval-iters global batches (data: the DataConfig), at the full --seq-length."""
    if curriculum is not None:
        _change_sequence_length(engine, curriculum.length, data.seq_length)
    engine.eval()
    _renew_pipeline_buffers(distillation, engine)
    losses = [run_global_batch(engine, iterator, accumulation_steps, train=False)[0] for _ in range(data.eval_iters)]
    engine.train()
    _renew_pipeline_buffers(distillation, engine)
    if curriculum is not None:
        _change_sequence_length(engine, data.seq_length, curriculum.length)
    return sum(losses) / len(losses)


def _renew_pipeline_buffers(distillation, engine):
    """--kd: the stages hand on the teacher's hidden states in training only, so the pipeline's buffers change."""
    if distillation is not None and isinstance(engine, deepspeed.PipelineEngine):
        engine.reset_activation_shape()


def _change_sequence_length(engine, old, new):
    """DeepSpeed's pipeline engine keeps its send/receive buffers from the first batch: renew them when the
    sequence length changes (Megatron-DeepSpeed does the same for its curriculum)."""
    if old != new and isinstance(engine, deepspeed.PipelineEngine):
        engine.reset_activation_shape()


def _sequence_length(engine, curriculum, iteration, seq_length):
    """This iteration's sequence length: the curriculum's, else --seq-length."""
    if curriculum is None:
        return seq_length
    previous = curriculum.length
    _change_sequence_length(engine, previous, curriculum.advance_to(iteration))
    return curriculum.length
