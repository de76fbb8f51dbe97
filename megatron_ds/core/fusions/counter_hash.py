"""The counter-based hash every dropout mask of the model comes from: a keep bit per (seed, row, column), no
random draw per element.

    seed = draw_seed(device)                          # one draw from the device's generator per dropout call
    keep = keep_mask(seed, rows, columns, drop_threshold(p))   # [len(rows), len(columns)] bool

`seed` is a 0-d int64 tensor in [0, 2**32), so activation recompute and the TP RNG tracker replay it as they
replay any draw, and a kernel can regenerate any element's bit from its index (nothing but the seed is kept for
backward). An element is dropped when its hash < p * 2**32: the keep rate is 1 - p to within 2**-32.

The hash is murmur3's 32-bit finaliser applied twice: fmix32(fmix32(row ^ seed) + column * 0x9E3779B9).
Its two halves are computed apart: the per-row hash and per-column mix once per row and column
(`row_hashes`, `column_mixes`), then the per-element finaliser (`keep_from_mixes`), all in int32 lanes holding
the 32-bit patterns, whose multiplies wrap as the hash needs. A compiled
graph given the two small vectors as inputs hashes an element in a few vector instructions; computed inside
the graph, inductor recomputes the row's hash for every 16 elements (a compiled masked scale of 4M fp32 elements
on 2 CPU threads: 1.31 ms so, 0.71 with the halves as inputs, 0.68 without a mask). `keep_tile`, for Triton
kernels, does the same in uint32.
"""
import torch

from megatron_ds.core.fusions._triton import tl, triton

_M32 = 0xFFFFFFFF
_FMIX_1, _FMIX_2 = 0x85EBCA6B, 0xC2B2AE35
_SIGN = 1 << 31
_FMIX_1_I32, _FMIX_2_I32 = (constant - (1 << 32) for constant in (_FMIX_1, _FMIX_2))  # as int32 lanes hold them
_GOLDEN = 0x9E3779B9


def draw_seed(device) -> torch.Tensor:
    """A 0-d int64 tensor in [0, 2**32) from device's generator (no host sync on CUDA)."""
    return torch.empty((), dtype=torch.int64, device=device).random_(0, 2 ** 32)


def drop_threshold(p: float) -> int:
    """Hash values below this are dropped."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(round(p * 2 ** 32)), _M32)


def _as_int32(x):
    """int64 values in [0, 2**32) -> the int32 tensor of the same bits."""
    return ((x ^ _SIGN) - _SIGN).to(torch.int32)


def row_hashes(seed, rows):
    """fmix32(row ^ seed) of int64 row indices, as int32 bits."""
    return _fmix32_lanes_(_as_int32((rows ^ seed) & _M32))


def column_mixes(columns):
    """column * 0x9E3779B9 mod 2**32 of int64 column indices, as int32 bits."""
    return _as_int32((columns * _GOLDEN) & _M32)


def _fmix32_lanes_(x):
    """fmix32 of int32 bit patterns, in place: the multiplies wrap; >> shifts in sign bits, masked off."""
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    x *= _FMIX_1_I32
    x ^= (x >> 13).bitwise_and_(0x7FFFF)
    x *= _FMIX_2_I32
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    return x


def keep_from_mixes(row_hash, column_mix, threshold: int):
    """[len(row_hash), len(column_mix)] bool from row_hashes and column_mixes: hash >= threshold, compared as
    unsigned (both sides' sign bits flipped)."""
    mixed = _fmix32_lanes_(row_hash[:, None] + column_mix[None, :])
    return mixed ^ -_SIGN >= threshold - _SIGN


def keep_mask(seed, rows, columns, threshold: int):
    """[len(rows), len(columns)] bool: True where the (row, column) element is kept. rows and columns are int64
    index vectors."""
    return keep_from_mixes(row_hashes(seed, rows), column_mixes(columns), threshold)


def device_function(fn):
    """A function kernels call. Unlike a kernel it is jitted at import, in the mode triton was imported in
    (as triton jits its own tl functions); without triton it stays plain Python and is never called."""
    return fn if triton is None else triton.jit(fn)


# the hash's constants as the kernels read them: a compiled kernel reads module globals only as constexprs
_GOLDEN_K, _FMIX_1_K, _FMIX_2_K = (tl.constexpr(value) for value in (_GOLDEN, _FMIX_1, _FMIX_2))


@device_function
def _fmix32_u32(x):
    x ^= x >> 16
    x *= _FMIX_1_K
    x ^= x >> 13
    x *= _FMIX_2_K
    return x ^ (x >> 16)


@device_function
def keep_tile(SEED, rows, columns, threshold):
    """keep_mask of a tile in uint32 arithmetic, which wraps as the hash needs: [len(rows), len(columns)] bool."""
    seed = tl.load(SEED).to(tl.uint32)
    row_hash = _fmix32_u32(rows.to(tl.uint32) ^ seed)
    return _fmix32_u32(row_hash[:, None] + columns.to(tl.uint32)[None, :] * _GOLDEN_K) >= threshold
