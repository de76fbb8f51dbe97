"""Which tokens of a sample each rank holds when Ulysses SP and context parallelism (CP) split it.

CP cuts the sequence into 2 x CP chunks and CP rank i holds chunks i and 2 CP - 1 - i (the ring's causal load
balance: transformer/ring_attention.py); the Ulysses ranks of a CP rank then hold consecutive slices of that part,
which Ulysses' all-to-all joins back into it. Without CP a rank's tokens are one contiguous slice, as Ulysses
alone always had them. Every token-wise input (tokens, labels, loss mask, position ids) is cut the same way, by
`local_positions`, and RoPE and the dropout masks key on those global positions.

    load_balanced_chunks(sequence_length, cp_size, cp_rank) -> the two slices of the sequence a CP rank holds
    context_parallel_positions(sequence_length, cp_size, cp_rank) -> their positions, in the rank's order
    positions_of(...) / local_positions(sequence_length) -> a rank's positions with Ulysses inside CP
    local_part(tensor) / whole_sequence(tensor) -> a rank's tokens of a sample / the sample from every rank's
    dropout_rows(hidden_states, p, training) -> the dropout masks' row numbers by global position
"""
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state


def load_balanced_chunks(sequence_length, cp_size, cp_rank):
    """The two slices of the sequence that CP rank cp_rank holds: chunks cp_rank and 2 cp_size - 1 - cp_rank of
    2 cp_size equal chunks."""
    _check_layout(sequence_length, cp_size, cp_rank)
    chunk = sequence_length // (2 * cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return slice(cp_rank * chunk, (cp_rank + 1) * chunk), slice(last * chunk, (last + 1) * chunk)


def _check_layout(sequence_length, cp_size, cp_rank):
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if sequence_length % (2 * cp_size):
        raise ValueError(f"sequence_length {sequence_length} is not divisible by 2 x cp_size = {2 * cp_size} "
                         "(context parallelism cuts the sequence into 2 chunks per rank)")


def context_parallel_positions(sequence_length, cp_size, cp_rank):
    """The global positions [s / cp_size] of the tokens CP rank cp_rank holds, in the order it holds them (for
    position embeddings and masks)."""
    return torch.cat([torch.arange(part.start, part.stop)
                      for part in load_balanced_chunks(sequence_length, cp_size, cp_rank)])


def positions_of(sequence_length, context_size=1, context_rank=0, ulysses_size=1, ulysses_rank=0, device=None,
                 ulysses_chunks=1):
    """The global positions (a LongTensor of sequence_length / (CP x SP)) of the tokens a rank holds, in its order.
    ulysses_chunks > 1 (FPDT, without CP): the sequence is cut into ulysses_chunks x SP pieces and Ulysses rank r
    holds pieces r, r + SP, r + 2 SP, ..., so that Ulysses' all-to-all of every rank's k-th piece gathers the k-th
    chunk of the sequence, in order (DeepSpeed's FPDT_InputConstruct)."""
    if ulysses_chunks > 1:
        piece = sequence_length // (ulysses_size * ulysses_chunks)
        return torch.cat([torch.arange(first, first + piece) for first in
                          range(ulysses_rank * piece, sequence_length, ulysses_size * piece)]).to(device)
    context_part = (context_parallel_positions(sequence_length, context_size, context_rank) if context_size > 1
                    else torch.arange(sequence_length))
    width = context_part.numel() // ulysses_size
    return context_part[ulysses_rank * width:(ulysses_rank + 1) * width].to(device)


def ulysses_chunks(sequence_length):
    """FPDT's chunks of a sequence (1 without FPDT)."""
    chunk = parallel_state.get_ulysses_chunk_size()
    return sequence_length // chunk if chunk else 1


def local_positions(sequence_length, device=None):
    """This rank's positions among a sample's sequence_length tokens (the parallel state's CP and Ulysses ranks)."""
    return positions_of(sequence_length, parallel_state.get_context_parallel_world_size(),
                        parallel_state.get_context_parallel_rank(),
                        parallel_state.get_sequence_parallel_world_size(),
                        parallel_state.get_sequence_parallel_rank(), device, ulysses_chunks(sequence_length))


def is_split():
    """Whether this run's ranks hold parts of each sample (Ulysses SP or CP above 1)."""
    return parallel_state.get_sequence_split_world_size() > 1


def local_part(tensor, dim=1):
    """This rank's tokens of a whole-sample tensor (the sequence along dim), as a new tensor."""
    return tensor.index_select(dim, local_positions(tensor.size(dim), tensor.device))


def whole_sequence(tensor, dim=1):
    """The whole sample from every sequence-split rank's part (the sequence along dim), on every rank; not
    differentiable."""
    ranks = parallel_state.get_sequence_split_world_size()
    if ranks == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(ranks)]
    dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_sequence_split_group())
    length = tensor.size(dim) * ranks
    context = parallel_state.get_context_parallel_world_size()
    ulysses = parallel_state.get_sequence_parallel_world_size()
    order = torch.cat([positions_of(length, context, index // ulysses, ulysses, index % ulysses,
                                    ulysses_chunks=ulysses_chunks(length))
                       for index in range(ranks)]).to(tensor.device)
    whole = torch.empty_like(torch.cat(parts, dim=dim))
    return whole.index_copy_(dim, order, torch.cat(parts, dim=dim))


def dropout_rows(hidden_states, p, training, sequence_parallel=False):
    """The numbers of the rows of a sequence-first activation [s, b, ...] for its dropout mask of probability p
    (core/fusions/dropout.py): global position x b + sample, so that a mask does not depend on how Ulysses and CP
    split the sequence; None where this rank holds whole samples (the rows' own numbers are then those) or where
    nothing is dropped. With Megatron SP the activation is this TP rank's share of the rank's tokens."""
    split = parallel_state.get_sequence_split_world_size()
    if split == 1 or not training or not p:
        return None
    tokens, batch = hidden_states.shape[:2]
    shares = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    positions = local_positions(tokens * shares * split, hidden_states.device)
    if shares > 1:
        share = parallel_state.get_tensor_model_parallel_rank()
        positions = positions[share * tokens:(share + 1) * tokens]
    return (positions[:, None] * batch + torch.arange(batch, device=hidden_states.device)).flatten()
