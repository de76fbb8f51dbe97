"""The one dropout mask of the model: every dropout (embedding, attention probabilities, bias-dropout-add in
every backend, flash attention) keeps an element where the counter hash (counter_hash.py) of one seed, drawn
per call from the current generator, and the element's index says so. So for a given generator state the
pattern does not depend on --fusion-backend, activation recompute (which restores the generator and TP RNG
tracker states) replays it, and a kernel can make the mask where it uses it, from the seed alone.

A tensor's element index is (row, column) of the tensor viewed as [numel / last dim, last dim]; a caller may
number the rows itself (`rows`: a rank holding parts of a sequence numbers its activations' rows by their global
positions, so that the mask does not depend on how the sequence is split: core/sequence_split.py). `bernoulli_`
drew one random number per element instead, which cost ~100 ms of a CPU iteration that hashes in a few ms
compiled; in plain PyTorch (`dropout_keep_mask`, its rows' hashes computed once) the hash of a [512, 4, 640] bf16
tensor takes 0.8x the time of one bernoulli_ over it on one CPU thread.
"""
import torch

from megatron_ds.core.fusions.counter_hash import column_mixes, draw_seed, drop_threshold, keep_from_mixes, row_hashes

HASH_CHUNK_ELEMENTS = 1 << 20
# a GPU launches some 15 small kernels per chunk: 16 per embedding dropout of a 1.3B model's micro batch (16.8M
# elements) in 1M chunks, one in these (their int32 temporaries, 8 bytes an element, 512 MiB at most)
CUDA_HASH_CHUNK_ELEMENTS = 1 << 26


def hash_chunk_elements(device):
    """Elements hashed at once in plain PyTorch on `device`: a bound on the hash's temporaries on a CPU, a few
    launches per mask on a GPU."""
    return CUDA_HASH_CHUNK_ELEMENTS if torch.device(device).type == "cuda" else HASH_CHUNK_ELEMENTS


def element_rows_and_columns(x):
    """(rows, columns) of x viewed as a matrix over its last dimension (a 0-d tensor is 1 x 1)."""
    columns = x.shape[-1] if x.dim() else 1
    return (x.numel() // columns if columns else 0), columns


def element_mixes(x, seed, rows=None):
    """(row_hashes, column_mixes) of x's elements, the per-row and per-column halves of their hashes: computed
    outside a compiled graph and passed in (counter_hash.py says why). rows: the rows' numbers (default 0, 1, ...)."""
    count, columns = element_rows_and_columns(x)
    rows = torch.arange(count, device=x.device) if rows is None else rows
    return row_hashes(seed, rows), column_mixes(torch.arange(columns, device=x.device))


def tensor_keep_mask(x, mixes, threshold: int):
    """Bool keep-mask shaped like x from its element_mixes, in one piece: for compiled graphs, which hash in
    registers."""
    row_hash, column_mix = mixes
    return keep_from_mixes(row_hash, column_mix, threshold).view(x.shape)


# tools/dry_run.py turns this off: its fake tensors hold no values to hash, and hashing them chunk by chunk took 49 of
# a rank's 55 s in a dry run at s 2048 x b 480. The mask is still made and kept (1 byte an element, what the planner
# plans); the hash's temporaries, which the fused kernels never make, are not. The seed is drawn all the same, so
# the generator moves as in a real run
hashes_keep_masks = True


def dropout_keep_mask(x, p: float, rows=None):
    """Bool keep-mask shaped like x (True = keep, probability 1 - p), from a seed drawn from the current
    device's generator (rows: the rows' numbers, default 0, 1, ...). Hashed hash_chunk_elements() at a time: plain
    PyTorch's hash holds two int32 temporaries per element it hashes, 8 bytes against the mask's 1 (for the local
    attention's s x s scores, more than the scores)."""
    threshold, seed = drop_threshold(p), draw_seed(x.device)
    if not hashes_keep_masks:
        return torch.empty(x.shape, dtype=torch.bool, device=x.device)
    count, columns = element_rows_and_columns(x)
    keep = torch.empty((count, columns), dtype=torch.bool, device=x.device)
    step = max(1, hash_chunk_elements(x.device) // max(columns, 1))
    row_hash, column_mix = element_mixes(x, seed, rows)
    for start in range(0, count, step):
        keep[start:start + step] = keep_from_mixes(row_hash[start:start + step], column_mix, threshold)
    return keep.view(x.shape)


class _MaskedScale(torch.autograd.Function):
    """x * keep * scale, saving only the bool mask (PyTorch's CPU dropout keeps its mask in x's dtype)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return (x * keep).mul_(scale)  # in place: one temporary of x's size, not two

    @staticmethod
    def backward(ctx, grad_output):
        (keep,) = ctx.saved_tensors
        return grad_output * keep * ctx.scale, None, None


def dropout(x, p: float, training: bool, rows=None):
    """Inverted dropout with the keep-mask of dropout_keep_mask (rows: the rows' numbers, default 0, 1, ...); the
    identity (no random draw) when not training or p == 0."""
    if not training or p == 0.0:
        return x
    return _MaskedScale.apply(x, dropout_keep_mask(x, p, rows), 1.0 / (1.0 - p))
