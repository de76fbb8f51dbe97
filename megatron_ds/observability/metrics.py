"""What training reports: Megatron's iteration and validation lines on the logging rank, its timers, and
scalars to TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project).

Every rank calls MetricsLogger.iteration after each iteration (and .validation after each evaluation). On
an iteration that logs, the statistics the flags ask for are reduced across all ranks (collectives in the
same order everywhere), then the logging rank (the first rank of the last pipeline stage) prints the line
and writes the scalars. Scalar names are Megatron's:

    always                           lm loss, learning-rate, consumed-samples, loss-scale, grad-norm,
                                     tokens-per-second, tflops-per-device, mfu; validation lm loss
    --log-batch-size-to-tensorboard  batch-size
    --log-world-size-to-tensorboard  world-size
    --log-validation-ppl-to-tensorboard  validation ppl (exp of the validation loss, capped at exp(20))
    --log-params-norm                params-norm (also "params norm:" in the iteration line)
    --log-num-zeros-in-grad          num-zeros (also "num zeros:" in the iteration line)
    --log-memory-to-tensorboard      mem-reserved-bytes, mem-allocated-bytes, mem-allocated-count (CUDA)
    --log-optimizer-states-to-tensorboard
                                     optimizer/{variance,variance_sqrt,momentum,weight}_{l2,l1,abs_max}
                                     (variance: Adam's exp_avg_sq, momentum: exp_avg, weight: fp32 master)
    --log-timers-to-tensorboard      iteration-time and <timer>-time (seconds per iteration, slowest rank)

After the first iteration that logs, Megatron's memory lines, once: the logging rank prints the planner's prediction
for its pipeline stage ("Theoretical memory footprints: weight and optimizer=... MB, activation=... MB, total=... MB",
the total being tools/plan.py's peak without its runtime overhead; from the rank that printed the iteration line, so
that the two never share a line of a launcher's merged output) and, on CUDA, the first data-parallel rank of every TP
rank and stage what the allocator saw ("[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated:
... | reserved: ... | max reserved: ..."), the logging rank's right after its prediction.

Norms and counts cover the whole model once: parameters that every TP rank holds count on TP rank 0,
the tied embedding's copy on the last pipeline stage not at all, and pieces of a ZeRO partition on the
data-parallel rank that owns them.
"""
import functools
import math
import os
import time

import torch
import torch.distributed as dist

from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.models.gpt import model_flops_per_iteration
from megatron_ds.launch.runtime import device, print_rank_0

# beside the lm loss in the iteration line, in order
OTHER_LOSSES = ("moe loss", "load balancing loss", "mtp loss", "kd loss")
EXPERT_LOAD = "tokens per expert max/mean"  # the dropless MoE layers' worst balance, after the losses
EXPERT_LOAD_OF_LAYER = "moe/tokens_per_expert_max_over_mean_layer_{}"  # each one's, by 0-based layer: TensorBoard

# --timing-log-level of each timer, in the order Megatron prints them
TIMER_LEVELS = {"forward-backward": 1, "forward-compute": 2, "backward-compute": 2, "batch-generator": 2,
                "forward-recv": 2, "forward-send": 2, "backward-recv": 2, "backward-send": 2,
                "embedding-grads-all-reduce": 1, "grads-all-reduce": 1, "optimizer": 1}
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def logging_rank(topology):
    """The first rank of the last pipeline stage (its TP, Ulysses and DP rank 0): it holds the loss."""
    return min(topology.filter_match(pipe=topology.get_dim("pipe") - 1))


def is_logging_rank():
    """Whether this rank prints the iteration lines and writes the scalars."""
    return dist.get_rank() == logging_rank(parallel_state.get_topology())


# --- timers -------------------------------------------------------------------------------------------

class Timers:
    """Megatron's timers up to --timing-log-level: the time spent inside the engine's calls, by name.

    A timed call that runs inside another (the gradient all-reduce inside the backward) pauses the outer
    one, so each timer counts its own time. On CUDA the device is synchronized at every start and stop."""

    def __init__(self, level, synchronize=None):
        self.elapsed = {name: 0.0 for name, timer_level in TIMER_LEVELS.items() if timer_level <= level}
        self.synchronize = synchronize or (lambda: None)
        self._running = []  # [names, start] of the calls in progress, innermost last

    @property
    def active(self):
        return bool(self.elapsed)

    def timed(self, names, function, when=lambda: True):
        """function, timed under the names this level keeps (those above it are dropped) while when() holds."""
        names = tuple(name for name in names if name in self.elapsed)
        if not names:
            return function

        def timed_call(*args, **kwargs):
            if not when():
                return function(*args, **kwargs)
            self._enter(names)
            try:
                return function(*args, **kwargs)
            finally:
                self._exit()
        return timed_call

    def _enter(self, names):
        self.synchronize()
        now = time.perf_counter()
        if self._running:
            self._add(*self._running[-1], now)
        self._running.append([names, now])

    def _exit(self):
        self.synchronize()
        now = time.perf_counter()
        self._add(*self._running.pop(), now)
        if self._running:
            self._running[-1][1] = now

    def _add(self, names, start, now):
        for name in names:
            self.elapsed[name] += now - start

    def min_max(self, iterations):
        """{name: (min, max) seconds per iteration across the ranks that timed it}; resets. Every rank calls it."""
        names = list(self.elapsed)
        local = torch.tensor([self.elapsed[name] for name in names], dtype=torch.float64, device=device())
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        table = torch.stack(gathered).cpu()
        self.elapsed = dict.fromkeys(names, 0.0)
        result = {}
        for index, name in enumerate(names):
            times = table[:, index][table[:, index] > 0]
            if times.numel():
                result[name] = (times.min().item() / iterations, times.max().item() / iterations)
        return result


def instrument_engine(engine, timers):
    """Time the engine's work under Megatron's timer names (training only, not evaluation): the plain
    engine's forward, backward, gradient all-reduce and step; the pipeline engine's instructions."""
    import deepspeed
    training = lambda: engine.training  # noqa: E731
    if isinstance(engine, deepspeed.PipelineEngine):
        from deepspeed.runtime.pipe import schedule
        names = {schedule.LoadMicroBatch: ("forward-backward", "batch-generator"),
                 schedule.ForwardPass: ("forward-backward", "forward-compute"),
                 schedule.BackwardPass: ("forward-backward", "backward-compute"),
                 schedule.SendActivation: ("forward-backward", "forward-send"),
                 schedule.RecvActivation: ("forward-backward", "forward-recv"),
                 schedule.SendGrad: ("forward-backward", "backward-send"),
                 schedule.RecvGrad: ("forward-backward", "backward-recv"),
                 schedule.ReduceTiedGrads: ("embedding-grads-all-reduce",),
                 schedule.ReduceGrads: ("grads-all-reduce",),
                 schedule.OptimizerStep: ("optimizer",)}
        deepspeed_internals.wrap_pipeline_instructions(
            engine, lambda instruction, method: timers.timed(names.get(instruction, ()), method, training))
        return
    for attribute, names in (("forward", ("forward-backward", "forward-compute")),
                             ("backward", ("forward-backward", "backward-compute")),
                             ("allreduce_gradients", ("grads-all-reduce",)), ("step", ("optimizer",))):
        setattr(engine, attribute, timers.timed(names, getattr(engine, attribute), training))


# --- statistics of the parameters, gradients and optimizer states --------------------------------------

def _counted_parameters(engine):
    """This rank's model parameters that count towards whole-model statistics (see the module docstring)."""
    first_stage = parallel_state.is_pipeline_first_stage()
    tp_first = parallel_state.get_tensor_model_parallel_rank() == 0
    for name, param in engine.module.named_parameters():
        shared_copy = name.startswith("tied_modules.") and not first_stage
        if (getattr(param, "tensor_model_parallel", False) or tp_first) and not shared_copy:
            yield param


def params_norm(engine):
    """L2 norm of the whole model's parameters (Megatron's params norm). Every rank calls it."""
    dp_first = parallel_state.get_sequence_data_parallel_rank() == 0  # one of the replicas (SP x DP)
    total = torch.zeros((), dtype=torch.float64, device=device())
    for param in _counted_parameters(engine):
        partitioned = hasattr(param, "ds_tensor")  # ZeRO-3: each data-parallel rank holds a partition
        if partitioned or dp_first:
            data = param.ds_tensor if partitioned else param.detach()
            total += torch.linalg.vector_norm(data, dtype=torch.float32).double() ** 2
    dist.all_reduce(total)
    return total.sqrt().item()


def optimizer_pieces(engine):
    """[(tensor the optimizer steps, start, numel)] holding this rank's share of the counted parameters
    (start None: the whole tensor), or None when the optimizer keeps them otherwise (ZeRO-3,
    DeepSpeed's FP16_Optimizer). ZeRO-1/2 and the BF16 optimizer step flat fp32 partitions, one per
    data-parallel rank; a plain torch optimizer steps the parameters, the same on every data-parallel rank
    (counted on the first)."""
    optimizer = engine.optimizer
    groups = deepspeed_internals.fp32_partition_groups(optimizer)
    params = list(_counted_parameters(engine))
    if groups:
        flats = [flat for _, flat in groups]
        pieces = []
        for param in params:
            mapping = deepspeed_internals.hp_mapping(param)
            if mapping is not None:  # None: no part of this parameter in this rank's partition
                address = mapping.hp_fragment_address
                pieces.append((flats[mapping.param_group_index], address.start, address.numel))
        return pieces
    if isinstance(optimizer, torch.optim.Optimizer) and not any(hasattr(p, "ds_id") for p in params):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if all(id(p) in stepped for p in params):
            replica_first = parallel_state.get_sequence_data_parallel_rank() == 0
            return [(param, None, None) for param in params] if replica_first else []
    return None


def _piece(tensor, start, numel):
    return tensor.detach().reshape(-1) if start is None else tensor.detach().reshape(-1).narrow(0, start, numel)


def _torch_optimizer(engine):
    """The torch optimizer that applies the step (DeepSpeed's ZeRO and BF16 optimizers wrap one)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def optimizer_state_norms(engine):
    """Megatron-DeepSpeed's optimizer/* scalars over the whole model (the optimizer's layout must be one
    optimizer_pieces knows). Every rank calls it."""
    pieces = optimizer_pieces(engine)  # now: a checkpoint load may have re-linked DeepSpeed's fragments
    state = _torch_optimizer(engine).state
    sums = torch.zeros(8, dtype=torch.float64, device=device())  # l2^2 of 4 kinds, then l1 of 4 kinds
    maxima = torch.zeros(4, dtype=torch.float64, device=device())
    has_moments = torch.zeros(1, dtype=torch.int32, device=device())
    for tensor, start, numel in pieces:
        moments = state.get(tensor, {})
        weight = _piece(tensor, start, numel).float()
        if all(key in moments for key in MOMENT_KEYS):
            has_moments += 1
            variance = _piece(moments["exp_avg_sq"], start, numel).float()
            kinds = (variance, variance.sqrt(), _piece(moments["exp_avg"], start, numel).float(), weight)
        else:
            kinds = (None, None, None, weight)
        for index, values in enumerate(kinds):
            if values is None or not values.numel():
                continue
            sums[index] += torch.linalg.vector_norm(values).double() ** 2
            sums[4 + index] += torch.linalg.vector_norm(values, ord=1).double()
            maxima[index] = torch.maximum(maxima[index], values.abs().max().double())
    dist.all_reduce(sums)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    dist.all_reduce(has_moments)
    kinds = ("variance", "variance_sqrt", "momentum", "weight") if has_moments.item() else ("weight",)
    scalars = {}
    for kind in kinds:
        index = ("variance", "variance_sqrt", "momentum", "weight").index(kind)
        scalars.update({f"optimizer/{kind}_l2": sums[index].sqrt().item(),
                        f"optimizer/{kind}_l1": sums[4 + index].item(),
                        f"optimizer/{kind}_abs_max": maxima[index].item()})
    return scalars


class GradientZeroCounter:
    """--log-num-zeros-in-grad: zeros in the gradients the optimizer applies (unscaled and clipped, after the
    data-parallel reduction), counted by a pre-step hook of the torch optimizer, as Megatron counts them
    in its optimizer step."""

    def __init__(self, engine):
        self.engine = engine
        self.spans = None  # id(stepped tensor) -> [(start, numel)], at the first step (after any checkpoint load)
        self.count = torch.zeros((), dtype=torch.float64, device=device())
        self.counted_step = None
        _torch_optimizer(engine).register_step_pre_hook(self._count)

    def _count(self, optimizer, args, kwargs):
        if self.spans is None:
            self.spans = {}
            for tensor, start, numel in optimizer_pieces(self.engine):
                self.spans.setdefault(id(tensor), []).append((start, numel))
        step = self.engine.global_steps  # DeepSpeed counts the step after the optimizer's
        if step != self.counted_step:  # ZeRO steps one parameter group at a time: the first call resets
            self.count.zero_()
            self.counted_step = step
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                if tensor.grad is None:
                    continue
                for start, numel in self.spans.get(id(tensor), ()):
                    grad = _piece(tensor.grad, start, numel)
                    self.count += grad.numel() - torch.count_nonzero(grad)

    def total(self):
        """Zeros in the last step's gradients over the whole model, or None when that step was skipped (fp16
        overflow). Every rank calls it."""
        if self.counted_step != self.engine.global_steps - 1:
            return None
        count = self.count.clone()
        dist.all_reduce(count)
        return count.item()


# --- where the scalars go -----------------------------------------------------------------------------

class ScalarWriters:
    """TensorBoard and Weights & Biases writers of the logging rank; the same scalars go to both."""

    def __init__(self, config):
        self.tensorboard = self.wandb = None
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size)
        if config.wandb_project:
            import wandb

            folder = config.wandb_save_dir or (os.path.join(config.save, "wandb") if config.save else None)
            if folder:
                os.makedirs(folder, exist_ok=True)
            self.wandb = wandb.init(project=config.wandb_project, name=config.wandb_exp_name or None, dir=folder,
                                    config=dict(config.command_line))

    def write(self, scalars, iteration):
        values = {name: float(value) for name, value in scalars.items() if value is not None}
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb is not None and values:
            self.wandb.log(values, step=iteration)

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


class MetricsLogger:
    """Megatron's iteration line on the logging rank, its timers, and the scalars (see the module docstring).
    With the engine given, the statistics and timers the flags ask for are set up on it."""

    def __init__(self, config, model, peak_tflops, engine=None, predicted_memory=None):
        """config: the run's LoggingConfig; model: its TransformerConfig; predicted_memory: the planner's
        StageMemory for the logging rank's pipeline stage, for the memory lines (None: no theoretical line)."""
        self.config = config
        # model FLOPs of one sample by sequence length (one length, or the curriculum's few)
        self.flops_per_sample = functools.lru_cache(maxsize=None)(
            lambda seq_length: model_flops_per_iteration(model, config.padded_vocab_size, 1, seq_length))
        self.peak_tflops = peak_tflops
        self.writing = bool(config.tensorboard_dir or config.wandb_project)  # the same on every rank
        self.writers = ScalarWriters(config) if self.writing and is_logging_rank() else None
        cuda = torch.cuda.is_available() and device().type == "cuda"
        self.timers = Timers(config.timing_log_level, torch.cuda.synchronize if cuda else None)
        self.memory = config.log_memory_to_tensorboard and cuda
        self.memory_report = MemoryReport(predicted_memory, cuda)
        self.optimizer_statistics = False  # the optimizer's layout is one optimizer_pieces knows
        self.zero_counter = None
        if engine is not None:
            self._set_up(engine, cuda)
        self._start_interval()

    def _start_interval(self):
        self.losses, self.other_losses, self.tokens, self.flops = [], {}, 0, 0
        self.interval_start = time.perf_counter()

    def _set_up(self, engine, cuda):
        config = self.config
        if self.timers.active:
            instrument_engine(engine, self.timers)
        notes = []
        if config.log_optimizer_states_to_tensorboard or config.log_num_zeros_in_grad:
            self.optimizer_statistics = optimizer_pieces(engine) is not None
            if not self.optimizer_statistics:
                flags = [flag for flag, given in (("--log-optimizer-states-to-tensorboard",
                                                   config.log_optimizer_states_to_tensorboard),
                                                  ("--log-num-zeros-in-grad", config.log_num_zeros_in_grad)) if given]
                notes.append(f"{' and '.join(flags)}: not available with DeepSpeed's {type(engine.optimizer).__name__} "
                             f"(ZeRO stage {config.zero_stage}); not logged")
            elif config.log_num_zeros_in_grad:
                self.zero_counter = GradientZeroCounter(engine)
        if config.log_memory_to_tensorboard and not cuda:
            notes.append("--log-memory-to-tensorboard: no CUDA device, so no device memory scalars (CPU run)")
        tensorboard_flags = [f"--log-{flag.replace('_', '-')}-to-tensorboard"
                             for flag in ("timers", "batch_size", "validation_ppl", "optimizer_states", "memory",
                                          "world_size") if getattr(config, f"log_{flag}_to_tensorboard")]
        if (config.wandb_exp_name or config.wandb_save_dir) and not config.wandb_project:
            notes.append("--wandb-exp-name / --wandb-save-dir without --wandb-project: Weights & Biases is off")
        if tensorboard_flags and not self.writing:
            notes.append(f"{', '.join(tensorboard_flags)} without --tensorboard-dir or --wandb-project: nothing is "
                         f"written")
        for note in notes:
            print_rank_0(f"note: {note}")

    def iteration(self, plan, loss, lr, engine, progress, other_losses=None):
        """plan: the IterationPlan the iteration ran; progress: the TrainingProgress after it; other_losses: {"moe
        loss": the MoE auxiliary loss, "kd loss": the distillation term}, those the run has."""
        config, iteration, batch_size, seq_length = self.config, plan.iteration, plan.global_batch_size, plan.seq_length
        self.losses.append(loss)
        for name, value in (other_losses or {}).items():
            self.other_losses.setdefault(name, []).append(value)
        self.tokens += batch_size * seq_length
        self.flops += self.flops_per_sample(seq_length) * batch_size
        if iteration % config.log_interval:
            return
        iterations = len(self.losses)
        elapsed = time.perf_counter() - self.interval_start
        tflops = self.flops / elapsed / config.world_size / 1e12
        scalars = {"lm loss": sum(self.losses) / iterations, "learning-rate": lr,
                   "consumed-samples": progress.consumed_train_samples,
                   "consumed-tokens": progress.consumed_train_tokens, "loss-scale": loss_scale(engine),
                   "grad-norm": engine.get_global_grad_norm(), "tokens-per-second": self.tokens / elapsed,
                   "tflops-per-device": tflops, "mfu": tflops / self.peak_tflops}
        if plan.by_curriculum:
            scalars["curriculum-seqlen"] = seq_length
        scalars.update({name: sum(values) / len(values) for name, values in self.other_losses.items()})
        seconds = elapsed / iterations
        scalars.update(self._statistics(engine))  # collectives: every rank
        timers = self.timers.min_max(iterations) if self.timers.active else {}
        if is_logging_rank():
            print(self._line(iteration, seconds, batch_size, scalars, engine), flush=True)
            if timers:
                print(_timers_text(timers), flush=True)
            if self.writers is not None:
                self.writers.write({**scalars, **self._tensorboard_only(batch_size, seconds, timers)}, iteration)
        self.memory_report.once(iteration)
        self._start_interval()

    def _statistics(self, engine):
        config, scalars = self.config, {}
        if config.log_params_norm:
            scalars["params-norm"] = params_norm(engine)
        if self.zero_counter is not None:
            scalars["num-zeros"] = self.zero_counter.total()
        if config.log_optimizer_states_to_tensorboard and self.writing and self.optimizer_statistics:
            scalars.update(optimizer_state_norms(engine))
        return scalars

    def _tensorboard_only(self, batch_size, seconds, timers):
        config, scalars = self.config, {}
        if config.log_batch_size_to_tensorboard:
            scalars["batch-size"] = batch_size
        if config.log_world_size_to_tensorboard:
            scalars["world-size"] = config.world_size
        if config.log_timers_to_tensorboard:
            scalars["iteration-time"] = seconds
            scalars.update({f"{name}-time": slowest for name, (_, slowest) in timers.items()})
        if self.memory:
            stats = torch.cuda.memory_stats()
            scalars.update({"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                            "mem-allocated-count": stats["allocation.all.current"]})
        return scalars

    def _line(self, iteration, seconds, batch_size, s, engine):
        config = self.config
        grad_norm = "nan" if s["grad-norm"] is None else f"{float(s['grad-norm']):.3f}"
        optional = ""
        if s.get("num-zeros") is not None:
            optional += f" num zeros: {s['num-zeros']:.1f} |"
        if s.get("params-norm") is not None:
            optional += f" params norm: {s['params-norm']:.3f} |"
        skipped = f" number of skipped iterations: {engine.skipped_steps} |" if config.fp16 else ""
        if s.get("curriculum-seqlen") is not None:
            optional += f" curriculum seqlen: {s['curriculum-seqlen']} |"
        others = "".join(f" {name}: {s[name]:.6E} |" for name in OTHER_LOSSES if s.get(name) is not None)
        if s.get(EXPERT_LOAD) is not None:
            others += f" {EXPERT_LOAD}: {s[EXPERT_LOAD]:.3f} |"
        return (f" iteration {iteration}/{config.train_iters} | consumed samples: {s['consumed-samples']} |"
                f" consumed tokens: {s['consumed-tokens']} |"
                f" elapsed time per iteration (ms): {seconds * 1000:.1f} | learning rate: {s['learning-rate']:.6E} |"
                f" global batch size: {batch_size} | lm loss: {s['lm loss']:.6E} |{others}"
                f" loss scale: {s['loss-scale']:.1f} | grad norm: {grad_norm} |{optional}{skipped}"
                f" tokens per second: {s['tokens-per-second']:.1f} | TFLOP/s per device: {s['tflops-per-device']:.3f} |"
                f" MFU: {100 * s['mfu']:.1f}% |")

    def validation(self, iteration, loss):
        if is_logging_rank():
            ppl = math.exp(min(20.0, loss))  # Megatron's cap
            print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |",
                  flush=True)
            if self.writers is not None:
                scalars = {"validation lm loss": loss}
                if self.config.log_validation_ppl_to_tensorboard:
                    scalars["validation ppl"] = ppl
                self.writers.write(scalars, iteration)

    def close(self):
        if self.writers is not None:
            self.writers.close()


MIB = 2 ** 20


class MemoryReport:
    """Megatron's memory lines (see the module docstring), printed once, when the optimizer's states exist."""

    def __init__(self, predicted, cuda):
        self.predicted, self.cuda, self.done = predicted, cuda, False

    def once(self, iteration):
        if self.done:
            return
        self.done = True
        if self.predicted is not None and is_logging_rank():
            print(theoretical_memory_line(self.predicted), flush=True)
        if self.cuda and parallel_state.get_sequence_data_parallel_rank() == 0:
            measured = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                        torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved())
            print(f"[Rank {dist.get_rank()}] {measured_memory_text(iteration, *measured)}", flush=True)


def theoretical_memory_line(stage_memory):
    """Megatron's line for the planner's StageMemory: model states, activations, and the peak (without the
    runtime overhead the allocator does not see)."""
    states = stage_memory.model_states + stage_memory.teacher
    return (f"Theoretical memory footprints: weight and optimizer={states / MIB:.2f} MB, "
            f"activation={stage_memory.activations / MIB:.2f} MB, "
            f"total={(stage_memory.total - stage_memory.overhead) / MIB:.2f} MB")


def measured_memory_text(iteration, allocated, max_allocated, reserved, max_reserved):
    """Megatron's report_memory text for the CUDA allocator's byte counts."""
    return (f"(after {iteration} iterations) memory (MB) | allocated: {allocated / MIB} | max allocated: "
            f"{max_allocated / MIB} | reserved: {reserved / MIB} | max reserved: {max_reserved / MIB}")


def _timers_text(timers):
    """Megatron's timer report: milliseconds per iteration, fastest and slowest rank."""
    lines = ["(min, max) time across ranks (ms):"]
    lines += [f"    {(name + ' ').ljust(48, '.')}: ({fastest * 1000:.2f}, {slowest * 1000:.2f})"
              for name, (fastest, slowest) in timers.items()]
    return "\n".join(lines)


def loss_scale(engine):
    """What DeepSpeed multiplies the loss by before backward: fp16's loss scale, else 1."""
    if not engine.fp16_enabled():
        return 1.0
    return deepspeed_internals.loss_scale(engine.optimizer)
