"""TransformerConfig: the one validated description of a transformer's shape and numerics."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron_ds.core.fusions.backends import BACKENDS as FUSION_BACKENDS
from megatron_ds.core.tensor_parallel.fp8 import FORMATS as FP8_FORMATS
from megatron_ds.core.tensor_parallel.fp8 import RECIPES as FP8_RECIPES
from megatron_ds.core.tensor_parallel.fp8_delayed import AMAX_COMPUTE_ALGOS

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
ROPE_TYPES = ("rope", "yarn")
# RoPE scaling (core/transformer/rotary.py), its fields named alike in the flags and here, Megatron's defaults:
# YaRN's (--rope-type yarn; Megatron-Core's MLA config names) and LLaMA-3.1's (--use-rope-scaling)
YARN_DEFAULTS = {"rotary_scaling_factor": 1.0, "original_max_position_embeddings": None, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
LLAMA3_SCALING_DEFAULTS = {"rope_scaling_factor": 8.0}
ROPE_SCALING_FIELDS = ("rope_type", *YARN_DEFAULTS, "use_rope_scaling", *LLAMA3_SCALING_DEFAULTS)
# multi-latent attention's fields, named alike in the flags and here
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim")
ATTENTION_BACKENDS = ("sdpa", "local", "flash")
RING_COMM_TYPES = ("p2p", "allgather")           # how the CP ranks exchange keys and values (a2a: Ulysses)
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")
MOE_TOKEN_DROP_POLICIES = ("probs", "position")
# DeepSpeed's router scores a group of experts by its best expert ("max") or its two best ("top2_sum",
# DeepSeek-V3's); Megatron-Core by the sum of its best topk / group_topk: these are the two it can take
MOE_GROUP_SCORES = {1: "max", 2: "top2_sum"}
# what full recompute means without a method or a count
DEFAULT_RECOMPUTE_METHOD, DEFAULT_RECOMPUTE_NUM_LAYERS = "uniform", 1


def default_ffn_hidden_size(hidden_size, gated_linear_unit):
    """Megatron's FFN width when none is given: 4h, or 8h/3 rounded down to a multiple of 64 with a GLU
    (the GLU's two input projections then hold about as many parameters as 4h without one)."""
    return int(8 * hidden_size / 3 / 64) * 64 if gated_linear_unit else 4 * hidden_size


@dataclass
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None      # None: multi-head attention (one group per head)
    ffn_hidden_size: Optional[int] = None       # None: 4h, or Megatron's 8h/3 rounded to 64 with a GLU
    kv_channels: Optional[int] = None           # None: hidden_size // num_attention_heads
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    normalization: str = "LayerNorm"
    gated_linear_unit: bool = False             # SwiGLU when True (with SiLU)
    bias: bool = True                           # biases on the linear layers
    add_qkv_bias: bool = False                  # a bias on the QKV projection even where bias is False (Qwen2)
    qk_layernorm: bool = False                  # `normalization` over each query and key head (Qwen3), before RoPE
    # multi-latent attention (DeepSeek-V3's; core/transformer/multi_latent_attention.py), Megatron-LM's defaults
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None           # None: queries through one projection, no low-rank latent
    kv_lora_rank: int = 32
    qk_head_dim: int = 128                      # each query and key head's channels without RoPE
    qk_pos_emb_head_dim: int = 64               # ... and with it (the decoupled rotary key, shared by the heads)
    v_head_dim: int = 128
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0                 # RoPE rotates the first int(kv_channels * this) channels of a head
    rope_type: str = "rope"                     # "yarn": YaRN's scaling, with the six fields below
    rotary_scaling_factor: float = YARN_DEFAULTS["rotary_scaling_factor"]
    original_max_position_embeddings: Optional[int] = None  # YaRN: the context before the extension
    beta_fast: float = YARN_DEFAULTS["beta_fast"]
    beta_slow: float = YARN_DEFAULTS["beta_slow"]
    mscale: float = YARN_DEFAULTS["mscale"]
    mscale_all_dim: float = YARN_DEFAULTS["mscale_all_dim"]
    use_rope_scaling: bool = False              # LLaMA-3.1's scaling, by rope_scaling_factor
    rope_scaling_factor: float = LLAMA3_SCALING_DEFAULTS["rope_scaling_factor"]
    attention_backend: str = "sdpa"
    cp_comm_type: str = "p2p"                   # context parallelism: "p2p" (the ring) or "allgather"
    fpdt_chunk_size: Optional[int] = None       # DeepSpeed's FPDT attention over chunks of this many tokens; None: off
    fpdt_offloading: bool = False               # FPDT keeps the chunks' keys and values in host memory
    init_method_std: float = 0.02
    init_seed: int = 1234                       # full-model initialization seed (same for every layout)
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False             # regions outside TP hold [s/t, b, h]
    recompute_granularity: Optional[str] = None  # None, "selective" (core attention) or "full" (whole layers)
    recompute_method: Optional[str] = None       # full only: "uniform" (chunks of N layers) or "block"
    recompute_num_layers: Optional[int] = None   # full only: N (default 1)
    distribute_saved_activations: bool = False   # full only: split each saved layer input across TP
    fusion_backend: str = "auto"                 # auto, triton, compile, apex, reference (core/fusions)
    masked_softmax_fusion: bool = True
    persist_layer_norm: bool = True              # fused LayerNorm / RMSNorm
    apply_rope_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    bias_dropout_fusion: bool = True
    cross_entropy_fusion: bool = True
    # Mixture of Experts (DeepSpeed-MoE, Megatron-DeepSpeed's flags): every expert_interval-th layer is an MoE
    # layer; num_experts holds one count for all of them, or one per MoE layer (PR-MoE's pyramid); 1 is dense
    num_experts: Tuple[int, ...] = (1,)
    expert_interval: int = 2
    moe_router_topk: int = 1
    moe_expert_parallel_size: int = 1
    moe_train_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True
    moe_top2_2nd_expert_sampling: bool = True
    moe_residual: bool = False                   # PR-MoE's residual: a dense MLP beside the experts
    moe_loss_coeff: float = 0.1                  # the auxiliary load-balancing loss's weight
    moe_expert_tensor_parallel: bool = False     # experts sharded over TP (else each whole on its rank)
    # Dropless Mixture of Experts (Megatron-Core's flags; core/transformer/dropless_moe.py): num_moe_experts
    # routed experts of moe_ffn_hidden_size in the layers moe_layer_pattern marks 1 (one 0/1 per layer)
    num_moe_experts: Optional[int] = None
    moe_layer_pattern: Optional[Tuple[int, ...]] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless; else each expert's capacity, in shares
    moe_token_drop_policy: str = "probs"                 # which pairs beyond an expert's capacity are dropped
    # multi-token prediction (core/transformer/multi_token_prediction.py): modules after the main model, 0 = none
    mtp_num_layers: int = 0
    # FP8 GEMMs (core/tensor_parallel/fp8.py) in the transformer layers' linears and experts; fp8_format None: off
    fp8_format: Optional[str] = None             # "e4m3", or "hybrid" (E5M2 gradients)
    fp8_recipe: str = "delayed"                  # "delayed", "tensorwise", "rowwise" or "blockwise"
    fp8_margin: int = 0                          # scale = fp8_max / amax / 2**margin
    fp8_amax_history_len: int = 1                # delayed: the steps whose amaxes choose the scale
    fp8_amax_compute_algo: str = "most_recent"   # delayed: the newest of them, or "max"
    first_last_layers_bf16: bool = False         # the first and last layers' GEMMs out of FP8 (Megatron-LM's names)
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_query_groups ({self.num_query_groups})")
        if self.kv_channels is None and self.multi_latent_attention:
            self.kv_channels = self.qk_head_dim + self.qk_pos_emb_head_dim  # the query's and key's head dim
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}) unless kv_channels is given")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.gated_linear_unit)
        if self.ffn_hidden_size <= 0:
            raise ValueError(f"TransformerConfig.ffn_hidden_size must be positive, got {self.ffn_hidden_size} "
                             f"(the SwiGLU default 8h/3 rounded down to 64 is 0 below hidden size 96)")
        self._check_choice("normalization", NORMALIZATIONS)
        self._check_choice("position_embedding_type", POSITION_EMBEDDING_TYPES)
        self._check_choice("attention_backend", ATTENTION_BACKENDS)
        self._check_choice("cp_comm_type", RING_COMM_TYPES)
        self._check_choice("fusion_backend", FUSION_BACKENDS)
        self._check_mla()
        self._check_rotary()
        self._check_recompute()
        self._check_moe()
        self._check_dropless_moe()
        self._check_fp8()

    def _check_fp8(self):
        if self.fp8_format is None:
            return
        self._check_choice("fp8_format", FP8_FORMATS)
        self._check_choice("fp8_recipe", FP8_RECIPES)
        self._check_choice("fp8_amax_compute_algo", AMAX_COMPUTE_ALGOS)
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len {self.fp8_amax_history_len} must be >= 1")
        if self.fp8_recipe == "delayed" and self.is_moe:
            raise ValueError("fp8_recipe delayed with DeepSpeed-MoE's experts: their amax histories are not built; "
                             "use tensorwise, rowwise or blockwise")
        if min(self.fp8_margin, self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16) < 0:
            raise ValueError(f"fp8_margin {self.fp8_margin}, num_layers_at_start_in_bf16 "
                             f"{self.num_layers_at_start_in_bf16} and num_layers_at_end_in_bf16 "
                             f"{self.num_layers_at_end_in_bf16} must be >= 0")

    def fp8_in_layer(self, layer_number) -> bool:
        """Whether layer layer_number's (1-based, global) GEMMs run in FP8: every layer's with fp8_format, but the
        first and last ones with first_last_layers_bf16 (a multi-token prediction module's layer comes after the
        last)."""
        if self.fp8_format is None:
            return False
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 < layer_number <= self.num_layers - self.num_layers_at_end_in_bf16

    def _check_rotary(self):
        errors = rope_scaling_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"TransformerConfig.rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and not self.multi_latent_attention and (
                self.rotary_dim % 2 or self.rotary_dim < 2
                or self.kv_channels * self.rotary_percent - self.rotary_dim > 1e-6):
            raise ValueError(f"rotary embeddings rotate kv_channels x rotary_percent = {self.kv_channels} x "
                             f"{self.rotary_percent} = {self.kv_channels * self.rotary_percent:g} channels of each "
                             f"head: that must be an even integer >= 2")

    def _check_mla(self):
        errors = mla_errors(self) if self.multi_latent_attention else []
        if errors:
            raise ValueError("; ".join(errors))

    def _check_recompute(self):
        if self.recompute_granularity not in (None, *RECOMPUTE_GRANULARITIES):
            raise ValueError(f"TransformerConfig.recompute_granularity must be None, 'selective' or 'full', "
                             f"got {self.recompute_granularity!r}")
        full = self.recompute_granularity == "full"
        if full:
            self.recompute_method = self.recompute_method or DEFAULT_RECOMPUTE_METHOD
            self.recompute_num_layers = self.recompute_num_layers or DEFAULT_RECOMPUTE_NUM_LAYERS
        if self.recompute_method not in (RECOMPUTE_METHODS if full else (None,)):
            raise ValueError(f"recompute_method {self.recompute_method!r} needs recompute_granularity 'full' and "
                             f"is 'uniform' or 'block'")
        if self.recompute_num_layers is not None and (not full or self.recompute_num_layers < 1):
            raise ValueError(f"recompute_num_layers {self.recompute_num_layers} needs recompute_granularity "
                             f"'full' and must be >= 1")
        if self.distribute_saved_activations and (not full or self.sequence_parallel):
            raise ValueError("distribute_saved_activations needs recompute_granularity 'full' and no sequence "
                             "parallelism (with SP the saved inputs are already split)")

    def _check_moe(self):
        self.num_experts = tuple(self.num_experts)
        moe_layers = self.num_layers // self.expert_interval if self.expert_interval > 0 else 0
        if self.expert_interval < 1 or len(self.num_experts) not in (1, moe_layers) or min(self.num_experts) < 1:
            raise ValueError(f"num_experts {list(self.num_experts)} must be one count >= 1, or one per MoE layer "
                             f"({moe_layers} with num_layers {self.num_layers} and expert_interval "
                             f"{self.expert_interval})")
        ep = self.moe_expert_parallel_size
        if self.is_moe and any(count % ep for count in self.num_experts if count > 1):
            raise ValueError(f"num_experts {list(self.num_experts)} must be multiples of moe_expert_parallel_size "
                             f"{ep}")
        if self.moe_router_topk < 1:
            raise ValueError(f"moe_router_topk must be >= 1, got {self.moe_router_topk}")

    def _check_dropless_moe(self):
        if self.num_moe_experts is None:
            return
        if self.moe_layer_pattern is None:
            self.moe_layer_pattern = (1,) * self.num_layers
        self.moe_layer_pattern = tuple(self.moe_layer_pattern)
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        errors = dropless_moe_errors(self)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def is_moe(self) -> bool:
        """A DeepSpeed-MoE model (Megatron-DeepSpeed's flags)."""
        return max(self.num_experts) > 1

    @property
    def is_dropless_moe(self) -> bool:
        """A model with dropless MoE layers (Megatron-Core's flags)."""
        return self.num_moe_experts is not None

    def dropless_moe_in_layer(self, layer_number) -> bool:
        """Whether layer layer_number (1-based, global) is a dropless MoE layer (moe_layer_pattern); a multi-token
        prediction module's layer (past num_layers) is of the last layer's kind, as Megatron-Core builds it."""
        return self.num_moe_experts is not None and bool(self.moe_layer_pattern[min(layer_number, self.num_layers) - 1])

    @property
    def moe_layer_pattern_with_mtp(self) -> Tuple[int, ...]:
        """moe_layer_pattern, then one 0/1 per multi-token prediction module's layer (layer numbers past num_layers)."""
        return tuple(self.moe_layer_pattern) + tuple(int(self.dropless_moe_in_layer(self.num_layers + depth))
                                                     for depth in range(1, self.mtp_num_layers + 1))

    def experts_in_layer(self, layer_number) -> int:
        """Experts of layer layer_number (1-based, global): Megatron-DeepSpeed's placement, every
        expert_interval-th layer (the pyramid's count for its group); 1 for a dense layer."""
        if layer_number % self.expert_interval:
            return 1
        return self.num_experts[0] if len(self.num_experts) == 1 else \
            self.num_experts[(layer_number - 1) // self.expert_interval]

    def _check_choice(self, name, choices):
        if getattr(self, name) not in choices:
            raise ValueError(f"TransformerConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")

    @property
    def rotary_dim(self) -> int:
        """The leading channels of each query and key head that RoPE rotates (Megatron's
        int(kv_channels * rotary_percent)); the rest pass through unrotated. MLA: its rotary part,
        qk_pos_emb_head_dim."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    @property
    def output_layer_init_std(self) -> float:
        """Megatron scales the init of the layers that write into the residual stream by 1/sqrt(2L)."""
        return self.init_method_std / (2.0 * self.num_layers) ** 0.5


def rope_scaling_errors(values):
    """What is wrong with a RoPE scaling, each problem naming its flags (values: a TransformerConfig, or the
    resolved flags: the names are the same)."""
    yarn, llama3 = values.rope_type == "yarn", values.use_rope_scaling
    errors = [] if values.rope_type in ROPE_TYPES else [f"--rope-type {values.rope_type}: one of {ROPE_TYPES}"]
    if (yarn or llama3) and values.position_embedding_type != "rope":
        asked = " and ".join(flag for flag, given in (("--rope-type yarn", yarn), ("--use-rope-scaling", llama3))
                             if given)
        errors.append(f"{asked}: RoPE scaling, and the model has --position-embedding-type "
                      f"{values.position_embedding_type}: add --use-rotary-position-embeddings (or "
                      f"--position-embedding-type rope)")
    if yarn and llama3:
        errors.append("--rope-type yarn and --use-rope-scaling are two RoPE scalings (YaRN's, LLaMA-3.1's): give one")
    if llama3 and not values.rope_scaling_factor > 0:
        errors.append(f"--rope-scaling-factor {values.rope_scaling_factor:g} must be > 0")
    errors += _yarn_errors(values) if yarn else _unused_flags(values, YARN_DEFAULTS, "YaRN", "--rope-type yarn")
    if not llama3:
        errors += _unused_flags(values, LLAMA3_SCALING_DEFAULTS, "LLaMA-3.1's RoPE scaling", "--use-rope-scaling")
    return errors


def mla_errors(values):
    """What multi-latent attention cannot take, each problem naming its flags (values: a TransformerConfig, or the
    resolved flags: the names are the same)."""
    errors = [f"--{name.replace('_', '-')} {getattr(values, name)} must be positive"
              for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank")
              if getattr(values, name) is not None and getattr(values, name) <= 0]
    for name in ("q_lora_rank", "kv_lora_rank"):
        rank = getattr(values, name)
        if rank is not None and rank > values.hidden_size:
            errors.append(f"--{name.replace('_', '-')} {rank} exceeds --hidden-size {values.hidden_size}: the "
                          f"latent is a compression of the hidden state")
    if values.qk_pos_emb_head_dim % 2:
        errors.append(f"--qk-pos-emb-head-dim {values.qk_pos_emb_head_dim}: RoPE rotates pairs of channels, it "
                      f"must be even")
    if values.position_embedding_type != "rope":
        errors.append(f"--multi-latent-attention rotates its decoupled key with RoPE: --position-embedding-type "
                      f"{values.position_embedding_type} is not rope (add --position-embedding-type rope)")
    unused = [flag for flag, given in _mla_unused_flags(values) if given]
    if unused:
        errors.append(f"--multi-latent-attention with {', '.join(unused)}: MLA has no key/value groups, QKV "
                      f"projection or per-head query/key norm, and RoPE rotates qk-pos-emb-head-dim channels whole")
    return errors


def _mla_unused_flags(values):
    kv_heads = getattr(values, "num_query_groups", None) or getattr(values, "num_key_value_heads", None)
    return ((f"--num-query-groups {kv_heads}", kv_heads not in (None, values.num_attention_heads)),
            ("--group-query-attention", getattr(values, "group_query_attention", False)),
            ("--qk-layernorm", values.qk_layernorm), ("--add-qkv-bias", values.add_qkv_bias),
            (f"--rotary-percent {values.rotary_percent:g}", values.rotary_percent != 1.0))


def _yarn_errors(values):
    original, errors = values.original_max_position_embeddings, []
    if original is None:
        errors.append("--rope-type yarn needs --original-max-position-embeddings: the context the model was trained "
                      "at before YaRN extends it (DeepSeek-V3: 4096)")
    elif original <= 0:
        errors.append(f"--original-max-position-embeddings must be positive, got {original}")
    if not values.rotary_scaling_factor > 0:
        errors.append(f"--rotary-scaling-factor {values.rotary_scaling_factor:g}: YaRN's factor must be > 0")
    if not 0 < values.beta_slow < values.beta_fast:
        errors.append(f"--beta-fast {values.beta_fast:g}, --beta-slow {values.beta_slow:g}: YaRN needs 0 < beta-slow "
                      f"< beta-fast (its ramp runs from the frequencies that turn beta-fast times over the original "
                      f"context to those that turn beta-slow times)")
    return errors


def _unused_flags(values, defaults, whose, switch):
    """The scaling's flags given other than their defaults without the switch that uses them."""
    given = [f"--{name.replace('_', '-')} {getattr(values, name):g}" for name, default in defaults.items()
             if getattr(values, name) != default]
    return [f"{', '.join(given)}: {whose}, unused without {switch}"] if given else []


def moe_group_score_function(topk, group_topk):
    """DeepSpeed's name for scoring a group of experts by its best topk // group_topk; None where it has none."""
    return MOE_GROUP_SCORES.get(topk // group_topk) if topk % group_topk == 0 else None


def moe_layer_pattern(freq, num_layers):
    """Megatron-LM's reading of --moe-layer-freq: N marks layers 0, N, 2N, ... (0-based); a list is the pattern."""
    return tuple(freq) if isinstance(freq, list) else tuple(int(layer % freq == 0) for layer in range(num_layers))


def dropless_moe_errors(config):
    """What the dropless MoE layer cannot do with this configuration, each naming Megatron-Core's flag."""
    experts, topk = config.num_moe_experts, config.moe_router_topk
    errors = []
    if experts < 1 or config.moe_expert_parallel_size < 1 or experts % config.moe_expert_parallel_size:
        errors.append(f"--num-experts {experts} must be a positive multiple of --expert-model-parallel-size "
                      f"{config.moe_expert_parallel_size}")
    if len(config.moe_layer_pattern) != config.num_layers or set(config.moe_layer_pattern) - {0, 1}:
        errors.append(f"--moe-layer-freq must give one 0 or 1 per layer ({config.num_layers}), got "
                      f"{list(config.moe_layer_pattern)}")
    if not config.gated_linear_unit:
        errors.append("the dropless MoE layer's experts are DeepSpeed's GroupedExperts, which compute gated "
                      "activations only: add --swiglu")
    if config.moe_router_score_function not in MOE_SCORE_FUNCTIONS:
        errors.append(f"--moe-router-score-function {config.moe_router_score_function}: one of "
                      f"{MOE_SCORE_FUNCTIONS}")
    if config.moe_router_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
        errors.append(f"--moe-router-load-balancing-type {config.moe_router_load_balancing_type}: one of "
                      f"{MOE_LOAD_BALANCING_TYPES}")
    if not 1 <= topk <= max(experts, 1):
        errors.append(f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}")
    return errors + _moe_group_errors(config) + _moe_dispatch_errors(config)


def _moe_dispatch_errors(config):
    errors = []
    if config.moe_token_dispatcher_type not in MOE_TOKEN_DISPATCHERS:
        errors.append(f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type}: one of "
                      f"{MOE_TOKEN_DISPATCHERS}")
    if config.moe_token_drop_policy not in MOE_TOKEN_DROP_POLICIES:
        errors.append(f"--moe-token-drop-policy {config.moe_token_drop_policy}: one of {MOE_TOKEN_DROP_POLICIES}")
    factor = config.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        errors.append(f"--moe-expert-capacity-factor {factor} must be > 0 (unset: no token dropped)")
    return errors


def _moe_group_errors(config):
    groups, group_topk, topk = config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk
    if groups is None and group_topk is None:
        return []
    if groups is None or group_topk is None:
        return ["--moe-router-num-groups and --moe-router-group-topk go together"]
    if groups < 1 or config.num_moe_experts % groups or not 1 <= group_topk <= groups:
        return [f"--moe-router-num-groups {groups} must divide --num-experts {config.num_moe_experts}, and "
                f"--moe-router-group-topk {group_topk} be between 1 and it"]
    if moe_group_score_function(topk, group_topk) is None:
        return [f"--moe-router-topk {topk} / --moe-router-group-topk {group_topk} must be 1 or 2: a group is "
                f"scored by its best expert or its two best (DeepSeek-V3), the two scores DeepSpeed's router has"]
    return []
