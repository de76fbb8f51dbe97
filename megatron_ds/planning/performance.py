"""Estimated iteration time, TFLOP/s per device and MFU.

The model (assumptions also printed with every plan and listed in docs/planning.md):
- compute runs at `compute_efficiency` x the device's peak (one factor for GEMMs and the memory-bound
  ops between them); with FP8 the GEMMs that run in FP8 at that fraction of the device's FP8 peak (H100: 1,979
  TFLOP/s dense against 989 in bf16), their quantisation counted in the same factor; communication at
  `bandwidth_efficiency` x link bandwidth; latency terms ignored (but FP8's amax all-reduces, below);
- nothing overlaps: TP collectives, Ulysses and MoE all-to-alls, pipeline sends/receives, the data-parallel
  reduction and the optimizer step all add to the compute time (Megatron's TP collectives and DeepSpeed's
  Ulysses all-to-alls sit on the critical path; DeepSpeed's pipeline engine sends/receives blockingly and
  reduces gradients after the last micro-batch); but CP's ring: each hop travels while a block computes, so only
  what a hop takes beyond its block's compute adds (context_exposed_seconds); allgather's gathers wait whole;
- FP8's amax all-reduces over TP (a few bytes each, communication.fp8_amax_reductions_per_micro_batch) cost
  `amax_all_reduce_latency_us` each, assumed (an NCCL all-reduce of a few bytes inside a node takes on the order
  of 10 us), not measured;
- 1F1B: an iteration takes (m + p - 1) slots of the slowest stage's forward + backward for one
  micro-batch, so the bubble is (p - 1) / (m + p - 1) of it; the other pipeline schedules are simulated with
  every stage as slow as the slowest (planning/pipeline.py);
- memory-bound work at `bandwidth_efficiency` x HBM bandwidth: with bf16 + ZeRO-1 DeepSpeed's BF16_Optimizer
  adds each micro-batch's bf16 gradients into its fp32 buffer (read 2 + 4, write 4 bytes per parameter);
  the optimizer step reads and writes its states once (read the fp32 gradient, read and write master, m,
  v, write the 16-bit weights).
"""
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_ds.planning import communication as comm
from megatron_ds.planning import pipeline
from megatron_ds.planning.hardware_flops import (
    forward_flops_per_token,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    stage_fp8_flops_per_micro_batch,
    stage_hardware_flops_per_micro_batch,
)
from megatron_ds.planning.model import Cluster, Layout, ModelSpec, expert_data_parallel_size
from megatron_ds.planning.parameters import StageParameters


@dataclass(frozen=True)
class PerformanceAssumptions:
    compute_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.7
    checkpoint_write_gbs: float = 20.0          # the file system's aggregate write bandwidth, GB/s
    mtbf_hours: Optional[float] = None          # the job's mean time between failures (a --save-interval for it)
    amax_all_reduce_latency_us: float = 10.0    # each FP8 amax all-reduce over TP: latency, its bytes are a few

    def describe(self, fp8: bool = False):
        return [f"compute at {self.compute_efficiency:.0%} of the device's peak FLOP/s (GEMMs and the "
                f"memory-bound ops between them, one factor)",
                f"communication at {self.bandwidth_efficiency:.0%} of link bandwidth (ring collectives, "
                f"no latency term); memory-bound work at {self.bandwidth_efficiency:.0%} of HBM bandwidth",
                "no overlap: TP collectives, Ulysses and MoE all-to-alls, pipeline sends/receives, the "
                "data-parallel reduction and the optimizer step add to compute time; CP's ring hops hide behind "
                "their attention blocks' compute (only the excess adds, and the last dK/dV hop), allgather's do not",
                "1F1B schedule: (m + p - 1) slots of the slowest stage's forward + backward per micro-batch; "
                "ZB-H1, interleaved and DualPipeV: their order simulated with every stage as slow as the slowest, "
                "forward : input gradient : weight gradient = 1 : 1 (2 with full recompute) : 1",
                *([f"FP8: GEMMs in FP8 at {self.compute_efficiency:.0%} of the device's FP8 peak; each amax "
                   f"all-reduce over TP {self.amax_all_reduce_latency_us:g} us (latency, assumed)"] if fp8 else []),
                f"checkpoints written at {self.checkpoint_write_gbs:g} GB/s in all (--checkpoint-write-gbs)"
                + (f"; a failure every {self.mtbf_hours:g} h (--mtbf-hours)" if self.mtbf_hours else "")]


def _grad_accumulation_bytes(model: ModelSpec, layout: Layout, parameters: int) -> float:
    """HBM bytes per micro-batch for BF16_Optimizer's fp32 accumulation (read bf16 + fp32, write fp32)."""
    return parameters * 10.0 if model.precision == "bf16" and layout.zero_stage == 1 else 0.0


def _optimizer_step_bytes(model: ModelSpec, layout: Layout, stage: StageParameters) -> float:
    """The device's ZeRO shard: non-expert parameters over U x DP, experts over TP x DP / EP."""
    zero = layout.zero_stage >= 1
    shard = (stage.non_expert / (layout.sequence_data_parallel if zero else 1)
             + stage.experts / (expert_data_parallel_size(model, layout) if zero else 1))
    weights = 2 if model.sixteen_bit else 0      # fp32 training updates the master copy in place
    return shard * (4 + 2 * 12 + weights)


@dataclass(frozen=True)
class StageTime:
    """Seconds one device of a stage spends per micro-batch (forward + backward), by cause."""
    stage: int
    compute: float
    tensor_parallel: float
    pipeline_p2p: float
    grad_accumulation: float
    expert_all_to_all: float = 0.0    # MoE dispatch and combine over the expert-parallel group
    ulysses_all_to_all: float = 0.0   # Ulysses q, k, v and context over the sequence-parallel group
    context_exposed: float = 0.0      # CP's key/value traffic not hidden behind the attention blocks
    context_hidden: float = 0.0       # CP's traffic behind the blocks' compute (not in the total)
    fp8_amax_reductions: int = 0      # FP8's amax all-reduces over TP
    fp8_amax_latency: float = 0.0     # their latency

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_parallel + self.pipeline_p2p + self.grad_accumulation
                + self.expert_all_to_all + self.ulysses_all_to_all + self.context_exposed + self.fp8_amax_latency)


def stage_time(model, layout, cluster, assumptions, stage: StageParameters, links) -> StageTime:
    flops = stage_hardware_flops_per_micro_batch(model, layout, stage.num_layers,
                                                 last=stage.stage == pipeline.head_rank(layout),
                                                 first_layer=stage.first_layer)
    sent = comm.stage_traffic_per_micro_batch(model, layout, stage)
    hbm = cluster.device.memory_bandwidth_gbs * 1e9 * assumptions.bandwidth_efficiency

    def seconds(nbytes, bandwidth):   # an axis the layout does not use sends nothing
        return nbytes / (bandwidth * assumptions.bandwidth_efficiency) if nbytes else 0.0

    rate = cluster.peak_flops(model.sixteen_bit) * assumptions.compute_efficiency
    fp8_flops = stage_fp8_flops_per_micro_batch(model, layout, stage.num_layers,
                                                last=stage.stage == pipeline.head_rank(layout),
                                                first_layer=stage.first_layer)
    fp8_seconds = fp8_flops / (cluster.peak_fp8_flops() * assumptions.compute_efficiency) if fp8_flops else 0.0
    context_link = links.context * assumptions.bandwidth_efficiency
    exposed = context_exposed_seconds(model, layout, stage.num_layers, rate, context_link)
    amax_reductions = comm.fp8_amax_reductions_per_micro_batch(model, layout, stage)[0]
    return StageTime(stage=stage.stage, compute=(flops - fp8_flops) / rate + fp8_seconds,
                     tensor_parallel=seconds(sent["tensor"], links.tensor),
                     pipeline_p2p=seconds(sent["pipeline"], links.pipeline),
                     grad_accumulation=_grad_accumulation_bytes(model, layout, stage.total) / hbm,
                     expert_all_to_all=seconds(sent["expert"], links.expert),
                     ulysses_all_to_all=seconds(sent["ulysses"], links.ulysses),
                     context_exposed=exposed, context_hidden=seconds(sent["context"], links.context) - exposed,
                     fp8_amax_reductions=amax_reductions,
                     fp8_amax_latency=amax_reductions * assumptions.amax_all_reduce_latency_us * 1e-6)


def attention_block_seconds(model: ModelSpec, layout: Layout, rate: float) -> float:
    """One CP block's attention forward on a rank, one layer and micro-batch: the rank's attention-score FLOPs
    (its s/(U CP) tokens' share of a/t heads over the whole s, as the planner counts them, causal or not) over
    the CP blocks, which the load balance makes equal."""
    per_token = forward_flops_per_token(model, layout.tp).attention_scores
    tokens = layout.micro_batch_size * layout.tokens_per_rank(model.seq_length, split_over_tp=False)
    return per_token * tokens / layout.tp / layout.context / rate


def context_exposed_seconds(model: ModelSpec, layout: Layout, num_layers: int, rate: float,
                            bandwidth: float) -> float:
    """CP's traffic per micro-batch that no block's compute hides (rate: FLOP/s, bandwidth: bytes/s, efficiencies
    applied). The ring: a hop travels while a block computes and costs only what it takes beyond it (forward,
    each of the CP - 1 key/value hops beside one block; backward, a block's backward (2 forwards) hides the next
    block's hop and the previous block's dK/dV, and the last dK/dV hop home is bare). allgather: all of it."""
    if layout.context == 1:
        return 0.0
    traffic = comm.context_traffic_per_layer(model, layout)
    if layout.cp_comm_type != "p2p":
        return comm.context_bytes_per_micro_batch(model, layout, num_layers) / bandwidth
    block = attention_block_seconds(model, layout, rate)
    forward = (layout.context - 1) * _beyond(traffic.block / bandwidth, block)
    backward = _ring_backward_exposed(layout.context, traffic.block / bandwidth, traffic.gradient_block / bandwidth,
                                      2 * block)
    return num_layers * (forward + backward) + comm.context_recomputed_layers(layout, num_layers) * forward


def _beyond(transfer: float, compute: float) -> float:
    return max(0.0, transfer - compute)


def _ring_backward_exposed(cp: int, hop: float, gradient_hop: float, block: float) -> float:
    """The ring's backward, in ring_attention's order: step 0 hides the next key/value hop, steps 1 to CP - 2 that
    hop and the previous block's dK/dV, step CP - 1 the last dK/dV hop but one; the last goes home bare."""
    middle = (cp - 2) * _beyond(hop + gradient_hop, block)
    return _beyond(hop, block) + middle + _beyond(gradient_hop, block) + gradient_hop


def estimate_performance(model: ModelSpec, layout: Layout, cluster: Cluster, stages, assumptions) -> dict:
    """Iteration time and its parts, TFLOP/s per device (hardware and model FLOPs) and MFU."""
    links = comm.links(layout, cluster, model.config.moe_expert_parallel_size)
    eff = assumptions.bandwidth_efficiency
    times = [stage_time(model, layout, cluster, assumptions, stage, links) for stage in stages]
    slowest = max(times, key=lambda t: t.total)
    schedule = pipeline.estimate(layout, slowest.total)
    largest = max(stages, key=lambda stage: stage.total)
    data_parallel = sum(comm.largest_stage_data_parallel_traffic(model, layout, stages).values()) / (links.data * eff)
    tied = comm.tied_embedding_traffic(model, layout) / (links.pipeline * eff)
    optimizer = _optimizer_step_bytes(model, layout, largest) / (cluster.device.memory_bandwidth_gbs * 1e9 * eff)
    iteration = schedule.seconds + data_parallel + tied + optimizer
    hardware, model_flops = hardware_flops_per_iteration(model, layout), model_flops_per_iteration(model, layout)
    peak = cluster.peak_flops(model.sixteen_bit)
    return {
        "iteration_s": iteration,
        "breakdown_s": {"pipeline": schedule.seconds, "of_which_bubble": schedule.seconds * schedule.bubble_fraction,
                        "data_parallel": data_parallel, "tied_embedding": tied, "optimizer_step": optimizer},
        "slowest_stage": asdict(slowest) | {"total": slowest.total},
        "pipeline_schedule": layout.pipeline_schedule,
        "bubble_fraction": schedule.bubble_fraction,
        "hardware_tflops_per_device": hardware / iteration / layout.world_size / 1e12,
        "model_tflops_per_device": model_flops / iteration / layout.world_size / 1e12,
        "mfu": model_flops / iteration / layout.world_size / peak,
        "tokens_per_second": layout.global_batch_size * model.seq_length / iteration,
        "links": asdict(links),
    }
