"""Build time of the GPT sample index (and of the blending index): compiled helper vs NumPy fallback.

    python bench/dataset_index.py [--tokens 1e8 1e9] [--seq-length 2048] [--repeats 3] [--blend-size 1e6]

Document lengths are lognormal with a mean of about 500 tokens (10^9 tokens: ~2M documents); the
document index is one shuffled epoch. The blend mixes three datasets (0.2, 0.5, 0.3).
"""
import argparse
import time

import numpy as np

from megatron_ds.data import index_helpers


def synthetic_lengths(num_tokens, rng, mean_length=500, sigma=1.0):
    """Lognormal document lengths (at least 1 token) summing to about num_tokens."""
    mu = np.log(mean_length) - sigma ** 2 / 2
    lengths = np.maximum(rng.lognormal(mu, sigma, int(num_tokens / mean_length * 1.1)), 1).astype(np.int32)
    cut = np.searchsorted(np.cumsum(lengths, dtype=np.int64), num_tokens)
    return lengths[:cut + 1]


def best_time(build, repeats):
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = build()
        times.append(time.perf_counter() - began)
    return min(times), result


def bench(num_tokens, seq_length, repeats, rng):
    lengths = synthetic_lengths(num_tokens, rng)
    document_index = rng.permutation(len(lengths)).astype(np.int32)
    args = (lengths, document_index, seq_length)
    cpp_seconds, from_cpp = best_time(lambda: index_helpers.build_sample_index_cpp(*args), repeats)
    numpy_seconds, from_numpy = best_time(lambda: index_helpers.build_sample_index_numpy(*args), repeats)
    assert np.array_equal(from_cpp, from_numpy), "the two builds differ"
    print(f"{num_tokens:.0e} tokens, {len(lengths):,} documents, seq {seq_length}: "
          f"{len(from_cpp) - 1:,} samples, index {from_cpp.nbytes / 2**20:.1f} MB ({from_cpp.dtype}) | "
          f"C++ {cpp_seconds * 1e3:.1f} ms, NumPy {numpy_seconds * 1e3:.1f} ms, "
          f"NumPy/C++ {numpy_seconds / cpp_seconds:.1f}x")


def bench_blend(size):
    weights = [0.2, 0.5, 0.3]
    cpp_seconds, from_cpp = best_time(lambda: index_helpers.build_blending_indices_cpp(weights, size), 1)
    python_seconds, from_python = best_time(lambda: index_helpers.build_blending_indices_numpy(weights, size), 1)
    assert all(np.array_equal(a, b) for a, b in zip(from_cpp, from_python)), "the two builds differ"
    megabytes = sum(a.nbytes for a in from_cpp) / 2**20
    print(f"blend of {size:,} samples over 3 datasets: index {megabytes:.1f} MB | C++ {cpp_seconds * 1e3:.1f} ms, "
          f"Python {python_seconds * 1e3:.1f} ms, Python/C++ {python_seconds / cpp_seconds:.0f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e8, 1e9])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blend-size", type=float, default=1e6, help="0 skips the blending benchmark")
    args = parser.parse_args()
    if index_helpers.compiled_helpers() is None:
        raise SystemExit("the C++ helpers did not build; nothing to compare")
    rng = np.random.default_rng(0)
    for num_tokens in args.tokens:
        bench(int(num_tokens), args.seq_length, args.repeats, rng)
    if args.blend_size:
        bench_blend(int(args.blend_size))


if __name__ == "__main__":
    main()
