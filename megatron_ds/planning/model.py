"""What a plan is about: the model (ModelSpec) and one 3D layout of it on a cluster (Layout, Cluster)."""
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_ds.arguments import padded_vocab_size
from megatron_ds.core.parallel_layout import ModelShape, ParallelLayout
from megatron_ds.core.pipeline_split import PipelineSplit
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.transformer_config import (
    DEFAULT_RECOMPUTE_METHOD,
    DEFAULT_RECOMPUTE_NUM_LAYERS,
    RECOMPUTE_GRANULARITIES,
)
from megatron_ds.launch.devices import DeviceSpec

RECOMPUTE_CHOICES = (None, *RECOMPUTE_GRANULARITIES)


@dataclass(frozen=True)
class ModelSpec:
    """The model as pretrain.py's flags describe it. vocab_size is the tokenizer's (unpadded) size: the
    embedding is padded to a multiple of make_vocab_size_divisible_by x TP, as in training."""
    config: TransformerConfig
    vocab_size: int
    make_vocab_size_divisible_by: int
    max_position_embeddings: int
    seq_length: int
    tied_embeddings: bool
    teacher: Optional["ModelSpec"] = None  # --kd: the frozen teacher (its shape from the --*-teacher flags)

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    @property
    def precision(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.config.params_dtype, "fp32")

    @property
    def sixteen_bit(self) -> bool:
        return self.precision != "fp32"

    def describe_precision(self) -> str:
        """"bf16", or "bf16, FP8 GEMMs (tensorwise, e4m3[, first 1 and last 1 layers bf16])"."""
        config = self.config
        if config.fp8_format is None:
            return self.precision
        kept = (f", first {config.num_layers_at_start_in_bf16} and last {config.num_layers_at_end_in_bf16} layers "
                f"bf16" if config.first_last_layers_bf16 else "")
        return f"{self.precision}, FP8 GEMMs ({config.fp8_recipe}, {config.fp8_format}{kept})"

    @property
    def learned_positions(self) -> bool:
        return self.config.position_embedding_type == "learned_absolute"


@dataclass(frozen=True)
class Layout:
    """One way to run the model: TP x Ulysses SP x CP x PP x DP, batch split and the memory-saving choices.
    Ranks are TP fastest, then Ulysses, then CP, then DP, then PP (core/parallel_state.py)."""
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    sequence_parallel: bool = False   # Megatron's --sequence-parallel: tokens outside attention split over TP
    recompute: Optional[str] = None   # None, "selective" (attention scores) or "full" (whole layers)
    zero_stage: int = 1
    recompute_method: str = DEFAULT_RECOMPUTE_METHOD  # full only: "uniform" (chunks of N layers) or "block"
    recompute_num_layers: int = DEFAULT_RECOMPUTE_NUM_LAYERS  # full only: N
    distribute_saved_activations: bool = False   # full only: saved layer inputs split across TP
    ulysses: int = 1                   # DeepSpeed-Ulysses SP (--ds-sequence-parallel-size): ranks splitting a sample
    pipeline_schedule: str = "1f1b"    # core/pipeline_schedules.py
    virtual_stages: int = 1            # model stages per pipeline rank: interleaved's v, dualpipev's 2
    split: PipelineSplit = PipelineSplit()  # the layers of each stage (Megatron-LM's uneven split flags)
    context: int = 1                   # context parallelism (--context-parallel-size): the ring's degree
    cp_comm_type: str = "p2p"          # the ring ("p2p") or key/value all-gathered at once ("allgather")

    @property
    def world_size(self) -> int:
        return self.tp * self.sequence_split * self.pp * self.dp

    @property
    def sequence_split(self) -> int:
        """Ranks splitting each sample's tokens: Ulysses SP x CP."""
        return self.ulysses * self.context

    @property
    def sequence_data_parallel(self) -> int:
        """Ranks holding the same weights of a stage, U x CP x DP: DeepSpeed reduces their gradients and ZeRO shards
        their states over them (parallel_state's sequence-data-parallel group; DP without Ulysses and CP)."""
        return self.sequence_split * self.dp

    def tokens_per_rank(self, seq_length: int, split_over_tp: Optional[bool] = None) -> float:
        """Tokens of a sample one rank holds outside attention: s / (U x CP), and / t again where Megatron's SP
        splits them (split_over_tp, by default the layout's --sequence-parallel)."""
        split_over_tp = self.sequence_parallel if split_over_tp is None else split_over_tp
        return seq_length / (self.sequence_split * (self.tp if split_over_tp else 1))

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per pipeline per iteration (= gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def recomputed_layers(self, stage_layers: int) -> int:
        """Layers of a stage that full recompute runs forward twice."""
        if self.recompute != "full":
            return 0
        return stage_layers if self.recompute_method == "uniform" else min(self.recompute_num_layers, stage_layers)

    def describe_recompute(self) -> str:
        if self.recompute != "full":
            return self.recompute or "none"
        chunk = "" if self.recompute_num_layers == 1 else f" {self.recompute_num_layers}"
        method = "" if self.recompute_method == "uniform" and not chunk else f" ({self.recompute_method}{chunk})"
        return "full" + method + (", saved inputs split over TP" if self.distribute_saved_activations else "")

    def describe_sizes(self) -> str:
        """"TP t x PP p x DP d", with "x Ulysses SP U" and "x CP c" (its exchange beside it unless the ring's)
        after TP when above 1."""
        sizes = ParallelLayout(self.world_size, tensor=self.tp, pipeline=self.pp, ulysses=self.ulysses,
                               context=self.context)
        exchange = f" ({self.cp_comm_type})" if self.context > 1 and self.cp_comm_type != "p2p" else ""
        return f"{sizes.describe_model_parallel()}{exchange} x DP {self.dp}"

    def describe(self) -> str:
        return (f"{self.describe_sizes()}, micro batch {self.micro_batch_size} x "
                f"{self.num_micro_batches} micro-batches, SP {'on' if self.sequence_parallel else 'off'}, "
                f"recompute {self.describe_recompute()}, ZeRO-{self.zero_stage}{self.describe_schedule()}"
                + ("" if self.split.is_even else f", uneven stages ({self.split.describe()})"))

    def describe_schedule(self) -> str:
        """", pipeline schedule S" (with its virtual stages for interleaved) when it is not 1F1B."""
        if self.pipeline_schedule == "1f1b" or self.pp == 1:
            return ""
        virtual = f" (v = {self.virtual_stages})" if self.pipeline_schedule == "interleaved" else ""
        return f", pipeline schedule {self.pipeline_schedule}{virtual}"


@dataclass(frozen=True)
class Cluster:
    device: DeviceSpec
    world_size: int
    gpus_per_node: int
    peak_tflops_override: Optional[float] = None   # --peak-tflops

    def peak_flops(self, sixteen_bit: bool) -> float:
        tflops = self.peak_tflops_override or self.device.peak_tflops(sixteen_bit)
        return tflops * 1e12

    def peak_fp8_flops(self) -> float:
        """The device's FP8 GEMM peak, scaled as --peak-tflops scales its 16-bit one (0 without FP8)."""
        scale = self.peak_tflops_override / self.device.peak_16bit_tflops if self.peak_tflops_override else 1.0
        return (self.device.peak_fp8_tflops or 0.0) * scale * 1e12


def fp8_device_errors(model: ModelSpec, device: DeviceSpec) -> List[str]:
    """FP8 asked for on a device without FP8 GEMMs: the device and what it lacks."""
    problem = device.fp8_problem() if model.config.fp8_format else None
    return [f"--fp8-format {model.config.fp8_format} cannot run on --device: {problem}"] if problem else []


def parallel_layout(model: ModelSpec, layout: Layout) -> ParallelLayout:
    """The layout's parallel degrees, with the model's expert parallelism (the rules and group sizes live there)."""
    config = model.config
    return ParallelLayout(world_size=layout.world_size, tensor=layout.tp, pipeline=layout.pp, ulysses=layout.ulysses,
                          context=layout.context, expert=config.moe_expert_parallel_size,
                          expert_tensor_parallel=config.moe_expert_tensor_parallel,
                          sequence_parallel=layout.sequence_parallel, zero_stage=layout.zero_stage,
                          pipeline_schedule=layout.pipeline_schedule, virtual_stages=layout.virtual_stages,
                          split=layout.split)


def model_shape(model: ModelSpec) -> ModelShape:
    config = model.config
    return ModelShape(num_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                      num_query_groups=config.num_query_groups, ffn_hidden_size=config.ffn_hidden_size,
                      seq_length=model.seq_length, num_experts=tuple(config.num_experts),
                      expert_interval=config.expert_interval,
                      dropless_moe_layers=config.moe_layer_pattern if config.is_dropless_moe else (),
                      mtp_num_layers=config.mtp_num_layers)


def expert_data_parallel_size(model: ModelSpec, layout: Layout) -> int:
    """Ranks holding the same experts (TP x DP / EP; DP / EP with expert tensor parallelism): the group expert
    gradients are reduced and their optimizer states ZeRO-partitioned over (the sequence-data-parallel group for
    everything else, and for a dense model)."""
    if not (model.config.is_moe or model.config.is_dropless_moe):
        return layout.sequence_data_parallel
    return parallel_layout(model, layout).expert_data_parallel


def layout_errors(model: ModelSpec, layout: Layout, world_size: Optional[int] = None) -> List[tuple]:
    """(reason, detail) for each rule the layout breaks (core/parallel_layout.py, the rules pretrain.py checks),
    before any memory or time estimate; with world_size, TP x U x CP x PP x DP must make it."""
    problems = parallel_layout(model, layout).problems(
        model_shape(model), batch=(layout.micro_batch_size, layout.global_batch_size))
    errors = [(problem.reason, problem.detail) for problem in problems]
    if world_size is not None and layout.world_size != world_size:
        errors.append(("layout does not match the world size", f"{layout.describe_sizes()} != {world_size}"))
    return errors
