"""tools/convert_checkpoint.py --from-megatron-deepspeed: checkpoints written here by code that follows
Megatron-DeepSpeed's file layout (megatron_ds/conversion/megatron_deepspeed.py's docstring; Megatron-DeepSpeed is not
vendored), its query_key_value rows built head by head from what each row means, converted and read back as ours."""
import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ds.checkpointing import files, state
from megatron_ds.conversion.megatron_deepspeed import qkv_in_our_order

REPO = Path(__file__).resolve().parents[2]
H, HEADS, GROUPS, D, FFN, LAYERS, VOCAB, POSITIONS = 16, 4, 2, 4, 32, 2, 64, 16
PER_GROUP = HEADS // GROUPS


def ours(seed=0):
    """A GPT-2 style model with grouped-query attention, by canonical name (rows of linear_qkv per query group:
    its 2 query heads, its key, its value)."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    weights = {"embedding.word_embeddings.weight": rand(VOCAB, H),
               "embedding.position_embeddings.weight": rand(POSITIONS, H),
               "decoder.final_layernorm.weight": rand(H), "decoder.final_layernorm.bias": rand(H)}
    qkv_rows = (HEADS + 2 * GROUPS) * D
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        weights.update({p + "input_layernorm.weight": rand(H), p + "input_layernorm.bias": rand(H),
                        p + "self_attention.linear_qkv.weight": rand(qkv_rows, H),
                        p + "self_attention.linear_qkv.bias": rand(qkv_rows),
                        p + "self_attention.linear_proj.weight": rand(H, H), p + "self_attention.linear_proj.bias": rand(H),
                        p + "pre_mlp_layernorm.weight": rand(H), p + "pre_mlp_layernorm.bias": rand(H),
                        p + "mlp.linear_fc1.weight": rand(FFN, H), p + "mlp.linear_fc1.bias": rand(FFN),
                        p + "mlp.linear_fc2.weight": rand(H, FFN), p + "mlp.linear_fc2.bias": rand(H)})
    return weights


def their_qkv(rows, tp, rank):
    """One TP shard's rows as checkpoint version 3.0 orders them: this rank's query heads, then its keys, then its
    values, each picked from our rows by what it is."""
    def query(head):
        group, within = divmod(head, PER_GROUP)
        return rows[(group * (PER_GROUP + 2) + within) * D:][:D]

    def key(group):
        return rows[(group * (PER_GROUP + 2) + PER_GROUP) * D:][:D]

    def value(group):
        return rows[(group * (PER_GROUP + 2) + PER_GROUP + 1) * D:][:D]
    heads, groups = range(rank * HEADS // tp, (rank + 1) * HEADS // tp), range(rank * GROUPS // tp, (rank + 1) * GROUPS // tp)
    return torch.cat([query(h) for h in heads] + [key(g) for g in groups] + [value(g) for g in groups])


_THEIRS = {"input_layernorm": "input_layernorm", "linear_qkv": "query_key_value", "linear_proj": "dense",
           "pre_mlp_layernorm": "post_attention_layernorm", "linear_fc1": "dense_h_to_4h", "linear_fc2": "dense_4h_to_h"}
_SPLIT_ROWS = ("linear_qkv", "linear_fc1")


def their_layer(weights, i, tp, rank):
    """Layer i's keys on TP rank `rank` (Megatron's splits: QKV and fc1 by rows, proj and fc2 weights by columns)."""
    layer = {}
    for name, value in weights.items():
        if not name.startswith(f"decoder.layers.{i}."):
            continue
        module, kind = name.split(".")[-2:]
        if module == "linear_qkv":
            value = their_qkv(value, tp, rank)
        elif module in _SPLIT_ROWS:
            value = value.chunk(tp)[rank]
        elif module in ("linear_proj", "linear_fc2") and kind == "weight":
            value = value.chunk(tp, dim=1)[rank]
        prefix = "self_attention." if module in ("linear_qkv", "linear_proj") else \
            "mlp." if module.startswith("linear_fc") else ""
        layer[f"{prefix}{_THEIRS[module]}.{kind}"] = value.clone()
    return layer


def megatron_deepspeed_checkpoint(load_dir, weights, tp, pp, iteration=5):
    tag = load_dir / f"global_step{iteration}"
    tag.mkdir(parents=True)
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                              ffn_hidden_size=FFN, padded_vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                              seq_length=POSITIONS, normalization="layernorm", params_dtype=torch.float32,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp,
                              data_parallel_size=1, consumed_train_samples=80, consumed_valid_samples=0,
                              global_batch_size=16, micro_batch_size=1)
    for rank in range(tp):
        embedding = {"word_embeddings.weight": weights["embedding.word_embeddings.weight"].chunk(tp)[rank].clone(),
                     "position_embeddings.weight": weights["embedding.position_embeddings.weight"].clone()}
        final = {"weight": weights["decoder.final_layernorm.weight"], "bias": weights["decoder.final_layernorm.bias"]}
        layers = [their_layer(weights, i, tp, rank) for i in range(LAYERS)]
        module = None
        if pp == 1:
            encoder = {f"layers.{i}.{key}": value for i, layer in enumerate(layers) for key, value in layer.items()}
            encoder.update({f"final_layernorm.{key}": value for key, value in final.items()})
            module = {"language_model": {"embedding": {"word_embeddings": {"weight": embedding["word_embeddings.weight"]},
                                                       "position_embeddings": {"weight": embedding["position_embeddings.weight"]}},
                                         "encoder": encoder}}
        else:
            for number, content in [(1, embedding), *[(i + 2, layer) for i, layer in enumerate(layers)],
                                    (LAYERS + 2, final), (LAYERS + 3, embedding)]:   # the tied copy last
                torch.save(content, tag / f"layer_{number:02d}-model_{rank:02d}-model_states.pt")
        torch.save({"module": module, "args": args, "checkpoint_version": 3.0, "iteration": iteration, "tokens": 1280,
                    "buffer_names": []}, tag / f"mp_rank_{rank:02d}_model_states.pt")
    (load_dir / "latest").write_text(tag.name)
    (load_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def convert(source, target, *flags):
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--from-megatron-deepspeed", str(source),
                           "--save", str(target), *flags], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1)], ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_its_weights_iteration_and_samples_arrive_as_ours(tmp_path, tp, pp):
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp)
    result = convert(tmp_path / "mds", tmp_path / "ours", "--target-tensor-parallel-size", "2",
                     "--target-pipeline-model-parallel-size", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"from Megatron-DeepSpeed's {tmp_path / 'mds' / 'global_step5'} (TP {tp} x PP {pp})" in result.stdout
    tag, metadata, _ = files.resolve_checkpoint(str(tmp_path / "ours"))
    assert (tag, metadata["iteration"], metadata["consumed_train_samples"]) == ("global_step5", 5, 80)
    full = state.read_full_state(str(tmp_path / "ours" / tag), metadata, with_optimizer=False)
    assert sorted(full.weights) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(full.weights[name], value), name
    assert full.model["num_key_value_heads"] == GROUPS and full.model["normalization"] == "LayerNorm"


def test_older_qkv_orders_are_read_or_refused_by_name():
    """Version 2.0: per head [q, k, v] (ours for one head per group); 1.0: per head the d rows interleaved
    (q0 k0 v0 q1 k1 v1 ...); grouped heads in either: not something Megatron-DeepSpeed wrote."""
    heads, d = 2, 3
    ours_rows = torch.arange(heads * 3 * d).float()             # head h: q rows, k rows, v rows
    interleaved = ours_rows.reshape(heads, 3, d).transpose(1, 2).reshape(-1)
    assert torch.equal(qkv_in_our_order(ours_rows, heads, heads, d, 2.0), ours_rows)
    assert torch.equal(qkv_in_our_order(interleaved, heads, heads, d, 1.0), ours_rows)
    with pytest.raises(files.CheckpointError, match="checkpoint_version 2.0 with grouped-query attention"):
        qkv_in_our_order(ours_rows, 4, 2, d, 2.0)
    with pytest.raises(files.CheckpointError, match=r"checkpoint_version 4.0 is not one megatron_ds reads"):
        qkv_in_our_order(ours_rows, heads, heads, d, 4.0)


@pytest.mark.e2e
def test_pretrain_goes_on_from_a_converted_checkpoint(tmp_path):
    from tests.launch import launch
    megatron_deepspeed_checkpoint(tmp_path / "mds", ours(), 1, 2)
    assert convert(tmp_path / "mds", tmp_path / "ours").returncode == 0
    flags = ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
             "--num-key-value-heads", str(GROUPS), "--ffn-hidden-size", str(FFN), "--seq-length", str(POSITIONS),
             "--max-position-embeddings", str(POSITIONS), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by",
             "32", "--micro-batch-size", "1", "--global-batch-size", "16", "--mock-data", "--train-iters", "6",
             "--lr", "1e-4", "--log-interval", "1", "--pipeline-model-parallel-size", "2",
             "--load", str(tmp_path / "ours")]
    result = launch(2, flags)
    assert result.returncode == 0, result.stdout
    assert "resuming at iteration 5, consumed samples 80" in result.stdout
    assert " iteration 6/6 | consumed samples: 96 |" in result.stdout
