"""What a plan is about: the model (ModelSpec) and one 3D layout of it on a cluster (Layout, Cluster)."""
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_ds.arguments import padded_vocab_size
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.transformer_config import stages_without_experts
from megatron_ds.planning.devices import DeviceSpec

RECOMPUTE_CHOICES = (None, "selective", "full")


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

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    @property
    def precision(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.config.params_dtype, "fp32")

    @property
    def sixteen_bit(self) -> bool:
        return self.precision != "fp32"

    @property
    def learned_positions(self) -> bool:
        return self.config.position_embedding_type == "learned_absolute"


@dataclass(frozen=True)
class Layout:
    """One way to run the model: TP x Ulysses SP x PP x DP, batch split and the memory-saving choices.
    Ranks are TP fastest, then Ulysses, then DP, then PP (core/parallel_state.py)."""
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    sequence_parallel: bool = False   # Megatron's --sequence-parallel: tokens outside attention split over TP
    recompute: Optional[str] = None   # None, "selective" (attention scores) or "full" (whole layers)
    zero_stage: int = 1
    recompute_method: str = "uniform"  # full only: "uniform" (chunks of N layers) or "block" (first N per stage)
    recompute_num_layers: int = 1      # full only: N
    distribute_saved_activations: bool = False   # full only: saved layer inputs split across TP
    ulysses: int = 1                   # DeepSpeed-Ulysses SP (--ds-sequence-parallel-size): ranks splitting a sample

    @property
    def world_size(self) -> int:
        return self.tp * self.ulysses * self.pp * self.dp

    @property
    def sequence_data_parallel(self) -> int:
        """Ranks holding the same weights of a stage, U x DP: DeepSpeed reduces their gradients and ZeRO shards
        their states over them (parallel_state's sequence-data-parallel group; DP without Ulysses)."""
        return self.ulysses * self.dp

    def tokens_per_rank(self, seq_length: int, split_over_tp: Optional[bool] = None) -> float:
        """Tokens of a sample one rank holds outside attention: s / U, and / t again where Megatron's SP splits
        them (split_over_tp, by default the layout's --sequence-parallel)."""
        split_over_tp = self.sequence_parallel if split_over_tp is None else split_over_tp
        return seq_length / (self.ulysses * (self.tp if split_over_tp else 1))

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
        """"TP t x PP p x DP d", with "x Ulysses SP U" after TP when U > 1."""
        ulysses = f" x Ulysses SP {self.ulysses}" if self.ulysses > 1 else ""
        return f"TP {self.tp}{ulysses} x PP {self.pp} x DP {self.dp}"

    def describe(self) -> str:
        return (f"{self.describe_sizes()}, micro batch {self.micro_batch_size} x "
                f"{self.num_micro_batches} micro-batches, SP {'on' if self.sequence_parallel else 'off'}, "
                f"recompute {self.describe_recompute()}, ZeRO-{self.zero_stage}")


@dataclass(frozen=True)
class Cluster:
    device: DeviceSpec
    world_size: int
    gpus_per_node: int
    peak_tflops_override: Optional[float] = None   # --peak-tflops

    def peak_flops(self, sixteen_bit: bool) -> float:
        tflops = self.peak_tflops_override or self.device.peak_tflops(sixteen_bit)
        return tflops * 1e12


def expert_data_parallel_size(model: ModelSpec, layout: Layout) -> int:
    """Ranks holding the same experts (TP x DP / EP: the experts are whole on each rank, spread over runs of EP
    ranks of a stage; DP / EP with expert tensor parallelism, the TP ranks holding different shards): the group
    expert gradients are reduced and their optimizer states ZeRO-partitioned over (the sequence-data-parallel
    group for everything else). U x DP for a dense model (MoE takes no Ulysses)."""
    config = model.config
    if not config.is_moe:
        return layout.sequence_data_parallel
    sharing = layout.dp if config.moe_expert_tensor_parallel else layout.tp * layout.dp
    return max(sharing // config.moe_expert_parallel_size, 1)


def layout_errors(model: ModelSpec, layout: Layout, world_size: Optional[int] = None) -> List[tuple]:
    """(reason, detail) for each rule the layout breaks, before any memory or time estimate; with world_size,
    TP x U x PP x DP must make it. The Ulysses rules mirror training's (arguments/checks.py, ulysses_errors): the
    tokens split over U (x TP with Megatron's SP), a TP rank's heads over U, no MoE."""
    config, tp, pp, u = model.config, layout.tp, layout.pp, layout.ulysses
    moe, ep = config.is_moe, config.moe_expert_parallel_size
    heads, megatron_sp = config.num_attention_heads, layout.sequence_parallel
    checks = [
        (config.num_attention_heads % tp, "heads not divisible by TP",
         f"{config.num_attention_heads} heads over TP {tp}"),
        (config.num_query_groups % tp, "kv heads not divisible by TP",
         f"{config.num_query_groups} kv heads over TP {tp}"),
        (config.ffn_hidden_size % tp, "FFN not divisible by TP", f"FFN {config.ffn_hidden_size} over TP {tp}"),
        (config.num_layers % pp, "layers not divisible by PP", f"{config.num_layers} layers over PP {pp}"),
        (layout.global_batch_size % (layout.micro_batch_size * layout.dp),
         "global batch not a multiple of micro batch x DP",
         f"{layout.global_batch_size} over {layout.micro_batch_size} x {layout.dp}"),
        (layout.zero_stage >= 2 and pp > 1, "ZeRO-2/3 with PP > 1",
         f"ZeRO-{layout.zero_stage} with PP {pp} (DeepSpeed's pipeline supports stage 0 or 1)"),
        (layout.sequence_parallel and model.seq_length % tp, "sequence not divisible by TP (SP)",
         f"sequence {model.seq_length} over TP {tp}"),
        (u > 1 and model.seq_length % (u * (tp if megatron_sp else 1)), "sequence not divisible by Ulysses SP",
         f"sequence {model.seq_length} over Ulysses SP {u}" + (f" x TP {tp} (SP)" if megatron_sp else "")),
        (u > 1 and heads % tp == 0 and (heads // tp) % u, "heads of a TP rank not divisible by Ulysses SP",
         f"{heads} heads over TP {tp} = {heads // tp} per TP rank, over Ulysses SP {u}"),
        (moe and u > 1, "MoE with Ulysses SP", f"Ulysses SP {u}: each rank's MoE layers would route its slice of "
                                               f"the sequence alone (pretrain.py refuses it)"),
        (moe and not config.moe_expert_tensor_parallel and (tp * layout.dp) % ep,
         "expert parallel size does not divide TP x DP",
         f"EP {ep} over TP {tp} x DP {layout.dp} (expert-parallel groups are runs of a stage's ranks)"),
        (moe and config.moe_expert_tensor_parallel and layout.dp % ep, "expert parallel size does not divide DP",
         f"EP {ep} over DP {layout.dp} (experts split over TP: expert-parallel groups are runs of DP ranks)"),
        (moe and layout.sequence_parallel, "MoE with sequence parallelism",
         "DeepSpeed's MoE splits replicated tokens over TP"),
        (moe and layout.zero_stage == 3, "ZeRO-3 with MoE", "DeepSpeed's ZeRO-3 does not shard MoE experts"),
        (moe and pp > 1 and config.num_layers % pp == 0
         and stages_without_experts(config.num_layers, pp, config.expert_interval),
         "a pipeline stage without MoE layers", f"PP {pp} with an MoE layer every {config.expert_interval} of "
                                                f"{config.num_layers} layers"),
        (world_size is not None and layout.world_size != world_size, "layout does not match the world size",
         f"{layout.describe_sizes()} != {world_size}"),
    ]
    return [(reason, detail) for broken, reason, detail in checks if broken]
