"""Self-attention: QKV column-parallel (each TP rank owns whole query groups), core attention on this
rank's heads, output projection row-parallel. Grouped-query attention when num_query_groups < heads.
--add-qkv-bias puts a bias on the QKV projection alone; --qk-layernorm normalises each query and key head over
its channels (Megatron-Core's q_layernorm / k_layernorm, Qwen3's q_norm / k_norm) before RoPE.
With DeepSpeed-Ulysses (--ds-sequence-parallel-size) the core attention sees the whole sequence for 1/SP of
the TP rank's heads, through DeepSpeed's DistributedAttention. With context parallelism (--context-parallel-size)
it sees this rank's two chunks of the sequence (or, with Ulysses, of the CP rank's part), and the keys and values
of the rest come round the CP ring (ring_attention.py; --cp-comm-type allgather: gathered at once); RoPE turns
every token by its global position (core/sequence_split.py). The flash backend, and the sdpa backend where
--fusion-backend compiles the flash_attention op (`auto` on a CPU, for a wide enough model), run causal
attention through that op: blocked, with a hashed dropout mask drawn as one seed per call; batches with a
document mask (--reset-attention-mask) go through sdpa."""
import math

import torch
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch._subclasses.fake_tensor import is_fake

from megatron_ds.core import deepspeed_internals
from megatron_ds.core.fusions import scale_mask_softmax_reference
from megatron_ds.core.fusions.counter_hash import draw_seed
from megatron_ds.core.fusions.dropout import dropout
from megatron_ds.core.fusions.flash_attention import flash_attention_footprint
from megatron_ds.core.parallel_state import (
    get_context_parallel_group,
    get_context_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_world_size,
    get_sequence_split_world_size,
    get_tensor_model_parallel_world_size,
)
from megatron_ds.core.sequence_split import local_positions
from megatron_ds.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, divide
from megatron_ds.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron_ds.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker, init_method_normal
from megatron_ds.core.transformer import ring_attention as ring
from megatron_ds.core.transformer.fused_ops import op_implementation, runs_flash_attention
from megatron_ds.core.transformer.norms import build_norm
from megatron_ds.core.transformer.rotary import RotaryEmbedding, apply_rotary


def local_attention(query, key, value, attention_mask, dropout_p, training, softmax=scale_mask_softmax_reference,
                    scale=None):
    """Explicit QK^T -> scale + mask + softmax -> dropout -> x V on [b, heads, s, d] tensors (value's head dim may
    differ from the query's): the path whose memory the paper counts (softmax output 2 as^2 b, dropout mask
    as^2 b, its output 2 as^2 b). The scale (default 1 / sqrt(d)) is applied to the scores so that q and k are
    saved as views of the QKV output. attention_mask None means causal; softmax is a core.fusions
    scale_mask_softmax."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2))
    probs = softmax(scores, attention_mask, scale, attention_mask is None)
    return torch.matmul(dropout(probs, dropout_p, training), value)


# what SDPA's dispatch (torch._fused_sdp_choice) may pick that takes GQA's grouped key and value heads as they are:
# flash attention and cuDNN (torch 2.11-2.13: sdp_utils.cpp's check_batch_size_and_num_heads_dense<true>); the
# memory-efficient kernel refuses them there (<false>: SDPA would fall back to its math path) and takes them in
# later releases, so the choice is asked, not assumed
_FUSED_SDPA_BACKENDS = {int(backend) for backend in (torch.backends.cuda.SDPBackend.FLASH_ATTENTION,
                                                     torch.backends.cuda.SDPBackend.EFFICIENT_ATTENTION,
                                                     torch.backends.cuda.SDPBackend.CUDNN_ATTENTION)}
FLASH_MAX_HEAD_DIM = 256  # torch's flash attention: head dims up to 256


def gpu_sdpa_takes_grouped_heads(dtype, head_dim):
    """Whether SDPA on an sm80+ GPU (A100, H100: what the planner and the dry run stand for), causal without a mask,
    takes GQA's grouped key and value heads in a fused kernel: its flash attention does, for fp16 and bf16 with head
    dims up to 256 (torch 2.11-2.13; on sm86/89/120 it also refuses training at head dims over 192). fp32 goes to
    the memory-efficient kernel, which takes no groups there."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim <= FLASH_MAX_HEAD_DIM


def sdpa_takes_grouped_heads(query, key, value, dropout_p=0.0):
    """Whether F.scaled_dot_product_attention, causal and without a mask, runs GQA's grouped key and value heads
    (query [b, heads, s, d], key and value [b, groups, s, d]) with enable_gqa=True in a kernel that takes them as
    they are, so that expanding them to every query head first would only copy them. On a CPU its flash kernel
    does; on CUDA the kernel SDPA's own dispatch picks for them (flash or cuDNN; not the memory-efficient one of
    torch 2.11-2.13, whose refusal sends SDPA to its math path). Fake tensors (the dry run's, on whatever device
    this machine has) have no kernel to ask and stand for an sm80+ GPU's (gpu_sdpa_takes_grouped_heads)."""
    if is_fake(query):
        return gpu_sdpa_takes_grouped_heads(query.dtype, query.size(-1))
    if query.device.type == "cpu":
        return True
    if query.device.type != "cuda":
        return False
    choice = torch._fused_sdp_choice(query, key, value, None, dropout_p, True, enable_gqa=True)
    return choice in _FUSED_SDPA_BACKENDS


def _repeat_heads(tensor, heads):
    """[b, groups, s, d] -> [b, heads, s, d], each group's head repeated for its query heads (a copy, unless a
    TP rank holds one group, where it stays a stride-0 view)."""
    b, groups, s, d = tensor.shape
    return tensor.unsqueeze(2).expand(b, groups, heads // groups, s, d).reshape(b, heads, s, d)


def sdpa_attention(query, key, value, attention_mask, dropout_p, training, softmax=None, scale=None):
    """torch's scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels where available; it draws
    its own dropout mask), scaled by `scale` (default 1 / sqrt(d)). softmax is unused. Causal attention may get
    GQA's grouped key and value heads (SelfAttention.takes_grouped_heads): they go in as they are
    (enable_gqa=True) where the kernel SDPA picks takes them (sdpa_takes_grouped_heads), else repeated to every
    query head first. A value head dim other than the query's (MLA) is padded to it: see _one_head_dim."""
    dropout_p = dropout_p if training else 0.0
    scale, value_dim = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale, value.size(-1)
    query, key, value = _one_head_dim(query, key, value)
    if attention_mask is None:
        grouped = key.size(1) != query.size(1)
        if grouped and not sdpa_takes_grouped_heads(query, key, value, dropout_p):
            key, value, grouped = _repeat_heads(key, query.size(1)), _repeat_heads(value, query.size(1)), False
        context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True,
                                                 enable_gqa=grouped, scale=scale)
    else:
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=~attention_mask, dropout_p=dropout_p,
                                                 scale=scale)
    return context if context.size(-1) == value_dim else context[..., :value_dim]


def _one_head_dim(query, key, value):
    """query, key and value with one head dim: torch's flash kernels (CPU and CUDA, torch 2.11-2.13) take a single
    one, and SDPA's dispatch sends a value head dim other than the query's to its math path, which holds the
    s x s scores (Megatron-Core pads MLA's values alike). Zeros are added: to the value's channels (the extra
    output channels are zeros, cut off after), or to the query's and key's (their scores unchanged; the scale is
    given explicitly)."""
    d, value_dim = query.size(-1), value.size(-1)
    if value_dim < d:
        return query, key, F.pad(value, (0, d - value_dim))
    if value_dim > d:
        return F.pad(query, (0, value_dim - d)), F.pad(key, (0, value_dim - d)), value
    return query, key, value


_BACKENDS = {"local": local_attention, "sdpa": sdpa_attention, "flash": sdpa_attention}  # flash: masked batches


class AttentionHeads(torch.nn.Module):
    """What SelfAttention and MultiLatentAttention share: RoPE's angles for this rank's tokens, and core attention
    on this rank's heads at softmax_scale (None: 1 / sqrt(the query's head dim)), through the configured backend,
    DeepSpeed-Ulysses' exchange and selective recompute."""

    def __init__(self, config, layer_number, softmax_scale=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.rotary = RotaryEmbedding.from_config(config) if config.position_embedding_type == "rope" else None
        self.core_attention = _BACKENDS[config.attention_backend]
        # DeepSpeed-Ulysses: each rank holds a slice of the sequence; DeepSpeed's DistributedAttention swaps it for
        # a slice of the heads (key and value already expanded to every head, so any GQA ratio splits)
        self.ulysses = None
        self.context_group = get_context_parallel_group() if get_context_parallel_world_size() > 1 else None
        if get_sequence_parallel_world_size() > 1:
            self.ulysses = DistributedAttention(self._attention_of_heads, get_sequence_parallel_group(),
                                                scatter_idx=2, gather_idx=0)
        self.softmax = op_implementation(config, "scale_mask_softmax")
        self.flash_attention = op_implementation(config, "flash_attention") if runs_flash_attention(config) else None
        self.rotary_pos_emb = op_implementation(config, "rotary_pos_emb")

    def rotary_angles(self, seq_len, device):
        """cos, sin for this rank's seq_len tokens, each at its place in the whole sequence (Ulysses and CP: the
        positions core/sequence_split.py gives this rank)."""
        split = get_sequence_split_world_size()
        if split == 1:
            return self.rotary(seq_len, device)
        return self.rotary(seq_len, device, positions=local_positions(seq_len * split, device))

    def attend(self, query, key, value, attention_mask):
        """Core attention of [s, b, heads, d] query and key and [s, b, heads, dv] value: [s, b, heads, dv]."""
        if self.ulysses is None:
            return self._attention_of_heads(query, key, value, attention_mask)
        # [s/SP, b, heads, d] -> all-to-all -> [s, b, heads/SP, d] -> attention -> all-to-all back
        return self.ulysses(query, key, value, 1, None, attention_mask)

    def _attention_of_heads(self, query, key, value, attention_mask):
        """Core attention on [s, b, heads, d] tensors (the layout DeepSpeed's DistributedAttention exchanges)."""
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        if self.config.recompute_granularity == "selective":
            context = checkpoint(self._core_attention, False, query, key, value, attention_mask)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        return context.permute(2, 0, 1, 3)

    def _core_attention(self, query, key, value, attention_mask):
        """Softmax(QK^T x scale) V for this rank's heads; its dropout differs per TP rank. Fake tensors (the
        dry run) take the flash kernels' footprint unless the backend is the explicit local one; the CP ring runs on
        them (its sends are the dry run's to record, its blocks the flash kernels' fakes)."""
        if self.context_group is not None:
            with get_cuda_rng_tracker().fork():
                return self._context_parallel_attention(query, key, value)
        if self.config.attention_backend != "local" and is_fake(query):
            return flash_attention_footprint(query, key, value,
                                             copies=self.flash_attention is not None and attention_mask is None)
        with get_cuda_rng_tracker().fork():
            if self.flash_attention is not None and attention_mask is None:
                return self._flash_attention(query, key, value)
            return self.core_attention(query, key, value, attention_mask, self.config.attention_dropout,
                                       self.training, self.softmax, scale=self.softmax_scale)

    def _context_parallel_attention(self, query, key, value):
        """Causal attention of this rank's queries over the whole sequence, the other CP ranks' keys and values
        brought round the ring (or gathered); dropout keyed by global positions, as the flash op's mask of the
        whole sequence."""
        dropout_p = self.config.attention_dropout if self.training else 0.0
        seed = draw_seed(query.device) if dropout_p else None
        attend = ring.all_gather_attention if self.config.cp_comm_type == "allgather" else ring.ring_attention
        return attend(query, key, value, self.context_group, causal=True, softmax_scale=self.softmax_scale,
                      dropout_p=dropout_p, seed=seed)

    def _flash_attention(self, query, key, value):
        dropout_p = self.config.attention_dropout if self.training else 0.0
        seed = draw_seed(query.device) if dropout_p else torch.zeros((), dtype=torch.int64, device=query.device)
        return self.flash_attention(query, key, value, dropout_p, seed, scale=self.softmax_scale)


class SelfAttention(AttentionHeads):
    def __init__(self, config, layer_number):
        super().__init__(config, layer_number)
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.kv_channels
        self.num_heads = divide(config.num_attention_heads, tp, "--num-attention-heads over TP:")
        self.num_groups = divide(config.num_query_groups, tp, "--num-key-value-heads over TP:")
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.num_query_groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, config=config,
                                               bias=config.bias or config.add_qkv_bias,
                                               init_method=init_method_normal(config.init_method_std))
        # Megatron-Core's q_layernorm / k_layernorm: one weight over head_dim for every head, whole on each TP
        # rank, whose gradient there comes from its own heads only
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = (build_norm(config, self.head_dim, partial_gradients=tp > 1)
                                                  for _ in range(2))
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                             config=config, bias=config.bias, input_is_parallel=True,
                                             skip_bias_add=True,
                                             init_method=init_method_normal(config.output_layer_init_std))

    def _split_qkv(self, mixed, expand=True):
        """[s, b, groups*(heads_per_group+2)*d] -> q [s, b, heads, d], k and v expanded to [s, b, heads, d]
        (without expand: [s, b, groups, d])."""
        s, b, _ = mixed.shape
        grouped = mixed.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        query, key, value = grouped.split([self.heads_per_group, 1, 1], dim=3)
        query, key = self.query_key_norms(query, key)
        heads = (s, b, self.num_heads, self.head_dim)
        if self.heads_per_group == 1 or not expand:  # k and v views, so backward keeps only the QKV output
            return query.reshape(heads), key.squeeze(3), value.squeeze(3)
        per_head = (s, b, self.num_groups, self.heads_per_group, self.head_dim)
        return (query.reshape(heads), key.expand(per_head).reshape(heads), value.expand(per_head).reshape(heads))

    def query_key_norms(self, query, key):
        """query and key through their norms (--qk-layernorm: over each head's channels), as they are without."""
        if self.q_layernorm is None:
            return query, key
        return self.q_layernorm(query), self.k_layernorm(key)

    def forward(self, hidden_states, attention_mask=None):
        if self.config.fpdt_chunk_size:
            return self._fpdt_forward(hidden_states)
        mixed, _ = self.linear_qkv(hidden_states)
        query, key, value = self._split_qkv(mixed, expand=not self.takes_grouped_heads(mixed, attention_mask))
        if self.rotary is not None:
            query, key = apply_rotary(query, key, *self.rotary_angles(query.size(0), query.device),
                                      self.rotary_pos_emb)
        context = self.attend(query, key, value, attention_mask)
        s, b = context.shape[:2]
        return self.linear_proj(context.reshape(s, b, self.num_heads * self.head_dim))

    def _fpdt_forward(self, hidden_states):
        """DeepSpeed's FPDT attention (QKV projection, Ulysses' all-to-alls chunk by chunk, attention, output
        projection) on this rank's chunks of the sequence (core/sequence_split.py): our QKV weight's rows reordered
        into its [Q; K; V] layout, the TP ranks' partial projections summed here."""
        rows = self._fpdt_qkv_rows(hidden_states.device)
        bias = self.linear_qkv.bias
        sequence = hidden_states.size(0) * get_sequence_parallel_world_size()
        output = deepspeed_internals.fpdt_attention(
            copy_to_tensor_model_parallel_region(hidden_states), self.linear_qkv.weight.index_select(0, rows),
            None if bias is None else bias.index_select(0, rows), self.linear_proj.weight,
            self._fpdt_rotary_angles(sequence, hidden_states), self.num_heads,
            self.num_groups, get_sequence_parallel_group(), self.config.fpdt_chunk_size, self.config.fpdt_offloading,
            (ring.attention_block, ring.attention_block_backward))
        return reduce_from_tensor_model_parallel_region(output), self.linear_proj.bias

    def _fpdt_rotary_angles(self, sequence, hidden_states):
        """cos and sin of the whole sequence in the activations' dtype (FPDT turns its chunks with them as they
        are; in fp32 they would promote bf16 queries and keys)."""
        if self.rotary is None:
            return None
        return tuple(angle.to(hidden_states.dtype) for angle in self.rotary(sequence, hidden_states.device))

    def _fpdt_qkv_rows(self, device):
        """Our QKV rows (per key/value group: its query heads, its key, its value) in FPDT's order: every query
        head, then every key, then every value."""
        per_group = (self.heads_per_group + 2) * self.head_dim
        group_starts = torch.arange(self.num_groups, device=device) * per_group
        within = torch.arange(self.head_dim, device=device)
        queries = (group_starts[:, None] + torch.arange(self.heads_per_group * self.head_dim, device=device)).flatten()
        keys = (group_starts[:, None] + self.heads_per_group * self.head_dim + within).flatten()
        values = (group_starts[:, None] + (self.heads_per_group + 1) * self.head_dim + within).flatten()
        return torch.cat([queries, keys, values])

    def takes_grouped_heads(self, mixed, attention_mask):
        """Whether core attention takes GQA's key and value heads as they are, not expanded to every query head:
        the flash op does; so does sdpa, causal, where the kernel it picks takes them (sdpa_takes_grouped_heads:
        a CPU's flash kernel; on CUDA flash attention or cuDNN, asked at the call, which repeats the heads itself
        where the pick refuses them; the dry run's fake tensors stand for an sm80+ GPU's, decided here by dtype and
        head dim, as the planner's memory model does); so does the CP ring, which sends them unexpanded. Ulysses'
        all-to-all and masked batches take every head expanded."""
        if self.ulysses is not None or attention_mask is not None:
            return False
        if self.context_group is not None or self.flash_attention is not None:
            return True
        if self.config.attention_backend != "sdpa" or self.heads_per_group == 1:
            return False
        if is_fake(mixed):
            return gpu_sdpa_takes_grouped_heads(mixed.dtype, self.head_dim)
        return mixed.device.type in ("cpu", "cuda")
