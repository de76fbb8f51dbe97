"""Checkpoint test helpers: a tiny model's flags, a sharded checkpoint written without training, the state of a
checkpoint that a killed save must leave behind, a file corrupted at the same size, and a --save folder's lock."""
import json
import os
import random
import socket

import torch

from megatron_ds.checkpointing import discovery, files, folder_lock, state

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "100",
        "--lr", "2e-3", "--log-interval", "1", "--seed", "11"]


def layout_flags(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--make-vocab-size-divisible-by", str(128 // tp)]


def full_state(folder):
    """The FullState of the checkpoint folder (every file of it read)."""
    return state.read_full_state(str(folder), files.read_metadata(str(folder)))


def tiny_checkpoint(save_dir, iteration, tp=1, pp=1, **model):
    """(folder, args) of a sharded checkpoint of a random tiny GPT-2 style model, written without training;
    `model` overrides flags of TINY (hidden_size=64 -> --hidden-size 64)."""
    from megatron_ds.arguments import parse_args
    overrides = sum(([f"--{key.replace('_', '-')}", str(value)] for key, value in model.items()), [])
    args = parse_args(TINY + ["--train-iters", "8", *overrides] + layout_flags(tp, pp), world_size=tp * pp)
    torch.manual_seed(iteration)
    full = state.FullState(args=files.args_to_dict(args), weights=_random_weights(args), iteration=iteration,
                           consumed_train_samples=iteration * args.global_batch_size)
    return state.write_sharded_checkpoint(full, str(save_dir), tp, pp, with_optimizer=False), args


def _random_weights(args):
    h, v, ffn = args.hidden_size, args.padded_vocab_size, args.ffn_hidden_size
    weights = {"embedding.word_embeddings.weight": torch.randn(v, h),
               "embedding.position_embeddings.weight": torch.randn(args.max_position_embeddings, h),
               "decoder.final_layernorm.weight": torch.ones(h), "decoder.final_layernorm.bias": torch.zeros(h)}
    for i in range(args.num_layers):
        p = f"decoder.layers.{i}."
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            weights[p + norm + ".weight"], weights[p + norm + ".bias"] = torch.ones(h), torch.zeros(h)
        weights.update({p + "self_attention.linear_qkv.weight": torch.randn(3 * h, h),
                        p + "self_attention.linear_qkv.bias": torch.randn(3 * h),
                        p + "self_attention.linear_proj.weight": torch.randn(h, h),
                        p + "self_attention.linear_proj.bias": torch.randn(h),
                        p + "mlp.linear_fc1.weight": torch.randn(ffn, h), p + "mlp.linear_fc1.bias": torch.randn(ffn),
                        p + "mlp.linear_fc2.weight": torch.randn(h, ffn), p + "mlp.linear_fc2.bias": torch.randn(h)})
    return weights


def assert_previous_checkpoint_published(save_dir):
    """A save of iteration 4 was killed: both pointers still name iteration 2, which is complete. Returns
    the notes resolve_checkpoint gives."""
    assert files.read_pointer(save_dir) == "global_step2"
    assert (save_dir / files.MEGATRON_TRACKER).read_text().strip() == "2"
    assert (save_dir / files.DEEPSPEED_POINTER).read_text().strip() == "global_step2"
    tag, metadata, notes = discovery.resolve_checkpoint(str(save_dir))
    assert (tag, metadata["iteration"]) == ("global_step2", 2)
    assert not files.problems_of(str(save_dir / "global_step2"))
    return notes


def corrupt_bytes(path, count=20 * 1024):
    """Overwrite `count` bytes in the middle of the file with random ones (at most a third of it), as a faulty
    disk or copy might: the size stays the same. Returns the offset."""
    size = os.path.getsize(path)
    count = min(count, size // 3)
    offset = (size - count) // 2
    with open(path, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(count)
        new = random.Random(offset).randbytes(count)
        assert new != old
        handle.seek(offset)
        handle.write(new)
    return offset


def write_lock(folder, **owner):
    """folder's lock (checkpointing/folder_lock.py), owned by this process unless `owner` says otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / folder_lock.LOCK_FILE).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "started": "2026-01-01T00:00:00+00:00", "job": "77",
         **owner}))
