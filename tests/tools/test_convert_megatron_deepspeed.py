"""tools/convert_checkpoint.py --from-megatron-deepspeed: checkpoints written here by code that follows
Megatron-DeepSpeed's file layout (checkpointing/foreign/megatron_deepspeed.py's docstring; Megatron-DeepSpeed is not
vendored), its query_key_value rows built head by head from what each row means, converted and read back as ours."""
import argparse
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ds.checkpointing import discovery, files, state
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.checkpointing.foreign.megatron_deepspeed import qkv_in_our_order

REPO = Path(__file__).resolve().parents[2]
H, HEADS, GROUPS, D, FFN, LAYERS, VOCAB, POSITIONS = 16, 4, 2, 4, 32, 2, 64, 16


def ours(seed=0, groups=GROUPS):
    """A GPT-2 style model with grouped-query attention (multi-head with groups=HEADS), by canonical name (rows of
    linear_qkv per query group: its query heads, its key, its value)."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    weights = {"embedding.word_embeddings.weight": rand(VOCAB, H),
               "embedding.position_embeddings.weight": rand(POSITIONS, H),
               "decoder.final_layernorm.weight": rand(H), "decoder.final_layernorm.bias": rand(H)}
    qkv_rows = (HEADS + 2 * groups) * D
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        weights.update({p + "input_layernorm.weight": rand(H), p + "input_layernorm.bias": rand(H),
                        p + "self_attention.linear_qkv.weight": rand(qkv_rows, H),
                        p + "self_attention.linear_qkv.bias": rand(qkv_rows),
                        p + "self_attention.linear_proj.weight": rand(H, H),
                        p + "self_attention.linear_proj.bias": rand(H),
                        p + "pre_mlp_layernorm.weight": rand(H), p + "pre_mlp_layernorm.bias": rand(H),
                        p + "mlp.linear_fc1.weight": rand(FFN, H), p + "mlp.linear_fc1.bias": rand(FFN),
                        p + "mlp.linear_fc2.weight": rand(H, FFN), p + "mlp.linear_fc2.bias": rand(H)})
    return weights


def their_qkv(rows, tp, rank, groups=GROUPS, version=3.0):
    """One TP shard's rows as checkpoint version 3.0 orders them: this rank's query heads, then its keys, then its
    values, each picked from our rows by what it is. Version 2.0 (multi-head only): per head its q, k, v rows."""
    per_group = HEADS // groups
    if version == 2.0:
        assert groups == HEADS
        return torch.cat([rows[head * 3 * D:][:3 * D] for head in range(rank * HEADS // tp, (rank + 1) * HEADS // tp)])

    def query(head):
        group, within = divmod(head, per_group)
        return rows[(group * (per_group + 2) + within) * D:][:D]

    def key(group):
        return rows[(group * (per_group + 2) + per_group) * D:][:D]

    def value(group):
        return rows[(group * (per_group + 2) + per_group + 1) * D:][:D]
    heads = range(rank * HEADS // tp, (rank + 1) * HEADS // tp)
    mine = range(rank * groups // tp, (rank + 1) * groups // tp)
    return torch.cat([query(h) for h in heads] + [key(g) for g in mine] + [value(g) for g in mine])


_THEIRS = {"input_layernorm": "input_layernorm", "linear_qkv": "query_key_value", "linear_proj": "dense",
           "pre_mlp_layernorm": "post_attention_layernorm", "linear_fc1": "dense_h_to_4h",
           "linear_fc2": "dense_4h_to_h"}
_SPLIT_ROWS = ("linear_qkv", "linear_fc1")


def their_layer(weights, i, tp, rank, groups=GROUPS, version=3.0):
    """Layer i's keys on TP rank `rank` (Megatron's splits: QKV and fc1 by rows, proj and fc2 weights by columns)."""
    layer = {}
    for name, value in weights.items():
        if not name.startswith(f"decoder.layers.{i}."):
            continue
        module, kind = name.split(".")[-2:]
        if ".mlp.experts." in name:   # in its expert files (megatron_deepspeed_moe_checkpoint)
            continue
        if ".mlp.deepspeed_moe.gate.wg." in name:
            layer[f"mlp.deepspeed_moe.gate.wg.{kind}"] = value.clone()
            continue
        if module == "linear_qkv":
            value = their_qkv(value, tp, rank, groups, version)
        elif module in _SPLIT_ROWS:
            value = value.chunk(tp)[rank]
        elif module in ("linear_proj", "linear_fc2") and kind == "weight":
            value = value.chunk(tp, dim=1)[rank]
        prefix = "self_attention." if module in ("linear_qkv", "linear_proj") else \
            "mlp." if module.startswith("linear_fc") else ""
        layer[f"{prefix}{_THEIRS[module]}.{kind}"] = value.clone()
    return layer


WORD, POSITION = "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"
ITERATION, SAMPLES, TOKENS, STEP, BATCH, TRAIN_ITERS, LR = 5, 80, 1280, 5, 16, 7, 1e-3


def adam_states(weights, seed=1):
    """{fp32, exp_avg, exp_avg_sq: {canonical name: tensor}}: the master weights are the (fp32) weights; moments
    of the size a few steps leave."""
    generator = torch.Generator().manual_seed(seed)
    return {"fp32": dict(weights),
            "exp_avg": {name: 1e-2 * torch.randn(value.shape, generator=generator) for name, value in weights.items()},
            "exp_avg_sq": {name: 1e-4 * torch.rand(value.shape, generator=generator)
                           for name, value in weights.items()}}


def their_parameters(values, tp, rank, stage, pp, groups=GROUPS, version=3.0):
    """{name as DeepSpeed's engine names the parameter: TP rank `rank`'s tensor} of pipeline stage `stage`: the
    nested module's names at PP 1, PipelineModule's `{layer file number}.{key}` and `tied_modules.embed.{key}` (on
    the first and the last stage) at PP > 1."""
    embedding = {"word_embeddings.weight": values[WORD].chunk(tp)[rank].clone(), "position_embeddings.weight":
                 values[POSITION].clone()}
    final = {"weight": values["decoder.final_layernorm.weight"], "bias": values["decoder.final_layernorm.bias"]}
    per_stage = LAYERS // pp
    layers = {i: their_layer(values, i, tp, rank, groups, version)
              for i in range(stage * per_stage, (stage + 1) * per_stage)}
    if pp == 1:
        return {**{f"language_model.embedding.{key}": value for key, value in embedding.items()},
                **{f"language_model.encoder.layers.{i}.{key}": value for i, layer in layers.items()
                   for key, value in layer.items()},
                **{f"language_model.encoder.final_layernorm.{key}": value for key, value in final.items()}}
    named = {f"tied_modules.embed.{key}": value for key, value in embedding.items()} \
        if stage in (0, pp - 1) else {}
    named.update({f"{i + 2}.{key}": value for i, layer in layers.items() for key, value in layer.items()})
    if stage == pp - 1:
        named.update({f"{LAYERS + 2}.{key}": value for key, value in final.items()})
    return named


def _module(named):
    """PP 1's nested `module`: language_model.{embedding: {word_embeddings: {weight}, ...}, encoder: {flat keys}}."""
    embedding, encoder = {}, {}
    for name, value in named.items():
        rest = name.removeprefix("language_model.")
        if rest.startswith("embedding."):
            module, key = rest.removeprefix("embedding.").split(".")
            embedding.setdefault(module, {})[key] = value
        else:
            encoder[rest.removeprefix("encoder.")] = value
    return {"language_model": {"embedding": embedding, "encoder": encoder}}


def _layer_files(tag, named, rank, stage):
    """PP > 1: one file per layer of the stage (the tied embedding: file 1 on the first; its copy on the last is a
    forward_fn layer, which DeepSpeed's PipelineModule does not save)."""
    by_number = {}
    for name, value in named.items():
        number, key = name.split(".", 1)
        if number == "tied_modules":
            if stage != 0:
                continue
            number, key = 1, key.removeprefix("embed.")
        by_number.setdefault(int(number), {})[key] = value
    for number, content in by_number.items():
        torch.save(content, tag / f"layer_{number:02d}-model_{rank:02d}-model_states.pt")


def _zero_files(tag, groups, moments, mp_rank, dp):
    """DeepSpeed's ZeRO-1 files of one model-parallel rank: each group's parameters flattened in order, padded to a
    multiple of 4 x dp, split in dp partitions (master weights and both moments alike)."""
    flats = {key: [torch.cat([by_name[name].flatten() for name in group]) for group in groups]
             for key, by_name in moments.items()}
    for key, group_flats in flats.items():
        flats[key] = [torch.nn.functional.pad(flat, (0, -flat.numel() % (4 * dp))).chunk(dp) for flat in group_flats]
    sizes = [[moments["fp32"][name].numel() for name in group] for group in groups]
    for replica in range(dp):
        state = {index: {"step": torch.tensor(float(STEP)), "exp_avg": flats["exp_avg"][index][replica].clone(),
                         "exp_avg_sq": flats["exp_avg_sq"][index][replica].clone()} for index in range(len(groups))}
        optimizer = {"zero_stage": 1, "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False,
                     "partition_count": [dp] * len(groups),
                     "base_optimizer_state": {"state": state, "param_groups": []},
                     "single_partition_of_fp32_groups": [flats["fp32"][index][replica].clone()
                                                         for index in range(len(groups))],
                     "param_slice_mappings": [_fragments(group, group_sizes, flats["fp32"][index][0].numel(), replica)
                                              for index, (group, group_sizes) in enumerate(zip(groups, sizes))]}
        torch.save({"optimizer_state_dict": optimizer, "ds_version": "0.19.8"},
                   tag / f"zero_pp_rank_{replica}_mp_rank_{mp_rank:02d}_optim_states.pt")


def _fragments(names, sizes, partition, replica):
    """DeepSpeed's param_slice_mappings of one data-parallel partition: each parameter's piece in it (its start in
    the partition and its length)."""
    from collections import OrderedDict

    from deepspeed.utils.tensor_fragment import fragment_address
    pieces, offset, low = OrderedDict(), 0, replica * partition
    for name, size in zip(names, sizes):
        start, end = max(offset, low), min(offset + size, low + partition)
        if start < end:
            pieces[name] = fragment_address(numel=end - start, start=start - low)
        offset += size
    return pieces


def their_scheduler():
    """Its OptimizerParamScheduler's state after ITERATION iterations of --train-iters TRAIN_ITERS: in samples."""
    return {"max_lr": LR, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": TRAIN_ITERS * BATCH,
            "lr_decay_style": "linear", "num_steps": SAMPLES, "lr_warmup_tokens": None, "lr_decay_tokens": None,
            "num_tokens": TOKENS - BATCH * POSITIONS, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant"}


def their_rng_state(seed):
    """What its get_rng_state saves (on CPU its `cuda_rng_state` is the CPU generator's again)."""
    generator = torch.Generator().manual_seed(seed)
    return {"random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": np.random.RandomState(seed).get_state(), "torch_rng_state": generator.get_state(),
            "cuda_rng_state": generator.get_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.Generator().manual_seed(seed + 1).get_state()}}


def their_universal_checkpoint_info(tp, pp):
    """What its save records for DeepSpeed's ds_to_universal (megatron/model/gpt_model.py's UniversalCheckpointInfo
    for this file's model: GPT-2 layers, tied embeddings, learned positions, LayerNorm, biases)."""
    from deepspeed.checkpoint import constants as ds
    layers = "" if pp > 1 else "language_model.encoder.layers."
    if pp > 1:
        vocabulary = [r"tied_modules.embed.word_embeddings.weight"]
        positions, final = r"tied_modules.embed.position_embeddings.weight", [r"\d+.weight", r"\d+.bias"]
    else:
        vocabulary = ["language_model.embedding.word_embeddings.weight"]
        positions = "language_model.embedding.position_embeddings.weight"
        final = ["language_model.encoder.final_layernorm.weight", "language_model.encoder.final_layernorm.bias"]
    info = {ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE, ds.ORIGINAL_VOCAB_SIZE: VOCAB,
            ds.PADDED_VOCAB_SIZE: VOCAB, ds.VOCABULARY_PARAMETER_PATTERNS: vocabulary,
            ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: []}
    if pp > 1:
        info[ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = vocabulary + [positions]
    if tp > 1:
        info[ds.TP_REPLICATED_PARAMETER_PATTERNS] = [
            layers + r"\d+.input_layernorm.weight", layers + r"\d+.post_attention_layernorm.weight", *final, positions,
            layers + r"\d+.self_attention.dense.bias", layers + r"\d+.mlp.dense_4h_to_h.bias",
            layers + r"\d+.input_layernorm.bias", layers + r"\d+.post_attention_layernorm.bias"]
        info[ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] = [layers + r"\d+.mlp.dense_4h_to_h.weight",
                                                            layers + r"\d+.self_attention.dense.weight"]
    return info


def megatron_deepspeed_checkpoint(load_dir, weights, tp, pp, iteration=ITERATION, moments=None, dp=1, groups=GROUPS,
                                  version=3.0):
    """Its files at TP tp x PP pp x DP dp, as checkpoint_version `version` writes them; with moments (adam_states) its
    ZeRO-1 files as well."""
    tag = load_dir / f"global_step{iteration}"
    tag.mkdir(parents=True)
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=groups,
                              ffn_hidden_size=FFN, padded_vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                              seq_length=POSITIONS, normalization="layernorm", params_dtype=torch.float32,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp * dp,
                              data_parallel_size=dp, consumed_train_samples=SAMPLES, consumed_valid_samples=0,
                              global_batch_size=BATCH, micro_batch_size=1, train_iters=TRAIN_ITERS, train_samples=None,
                              zero_stage=1 if moments else 0)
    for stage in range(pp):
        for rank in range(tp):
            mp_rank = stage * tp + rank
            named = their_parameters(weights, tp, rank, stage, pp, groups, version)
            if pp > 1:
                _layer_files(tag, named, rank, stage)
            states = {"module": _module(named) if pp == 1 else None, "args": args, "checkpoint_version": version,
                      "iteration": iteration, "tokens": TOKENS, "buffer_names": [], "lr_scheduler": their_scheduler(),
                      "rng_state": [their_rng_state(100 * mp_rank + replica) for replica in range(dp)],
                      "universal_checkpoint_info": their_universal_checkpoint_info(tp, pp)}
            if moments:
                param_groups = [[name for name, value in named.items() if value.dim() == 2],
                                [name for name, value in named.items() if value.dim() == 1]]
                states["param_shapes"] = [{name: named[name].shape for name in group} for group in param_groups]
                their_moments = {key: their_parameters(values, tp, rank, stage, pp, groups, version)
                                 for key, values in moments.items()}
                _zero_files(tag, param_groups, their_moments, mp_rank, dp)
            torch.save(states, tag / f"mp_rank_{mp_rank:02d}_model_states.pt")
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
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "ours"))
    assert (tag, metadata["iteration"], metadata["consumed_train_samples"]) == ("global_step5", 5, 80)
    full = state.read_full_state(str(tmp_path / "ours" / tag), metadata, with_optimizer=False)
    assert sorted(full.weights) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(full.weights[name], value), name
    assert full.model["num_key_value_heads"] == GROUPS and full.model["normalization"] == "LayerNorm"


OUR_SCHEDULE = {"schedule": {"max_lr": LR, "min_lr": 0.0, "decay_style": "linear", "warmup": 0,
                              "warmup_unit": "iterations", "decay": TRAIN_ITERS, "decay_unit": "iterations"},
                 "position": {"iterations": ITERATION, "samples": SAMPLES, "tokens": TOKENS}}


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 2)],
                         ids=["tp1pp1", "tp1pp2", "tp2pp1", "tp2pp2dp2"])
def test_its_adam_states_lr_schedule_and_tokens_arrive_as_ours(tmp_path, tp, pp, dp):
    """The ZeRO partitions cut through param_shapes (over dp ranks, two groups, padded), each TP shard's
    query_key_value rows reordered in the master weights and both moments, merged: exactly the moments the
    checkpoint was built from. Its sample-counted schedule of a --train-iters run is ours in iterations."""
    weights = ours()
    moments = adam_states(weights)
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=moments, dp=dp)
    result = convert(tmp_path / "mds", tmp_path / "ours")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"fp32 master weights and Adam moments (step {STEP}), its LR schedule" in result.stdout
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "ours"))
    assert (metadata["consumed_train_tokens"], metadata["scheduler"]) == (TOKENS, OUR_SCHEDULE)
    full = state.read_full_state(str(tmp_path / "ours" / tag), metadata)
    assert full.optimizer_step == STEP and sorted(full.optimizer) == sorted(weights)
    for key, values in moments.items():
        for name, value in values.items():
            assert torch.equal(full.optimizer[name][key], value), (key, name)


def test_its_tied_embedding_reaches_the_last_stage_from_file_1(tmp_path):
    """DeepSpeed writes no file for the last stage's tied copy (a forward_fn layer): a rank of another layout that
    holds the last stage reads the embedding from file 1, as DeepSpeed loads it into both stages."""
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, 1, 2, moments=adam_states(weights))
    path = str(tmp_path / "mds" / "global_step5")
    assert not (tmp_path / "mds" / "global_step5" / f"layer_{LAYERS + 3:02d}-model_00-model_states.pt").exists()
    names = [WORD, POSITION, "decoder.final_layernorm.weight", f"decoder.layers.{LAYERS - 1}.input_layernorm.bias"]
    rank = state.read_resharded_rank_state(path, megatron_deepspeed.read_metadata(path), (2, 1, False), names, VOCAB)
    assert torch.equal(rank.weights[WORD], weights[WORD].chunk(2)[1])
    assert torch.equal(rank.weights[POSITION], weights[POSITION])


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


def run_flags(load_dir, tp=1, pp=1, groups=GROUPS):
    return ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
            "--num-key-value-heads", str(groups), "--ffn-hidden-size", str(FFN), "--seq-length", str(POSITIONS),
            "--max-position-embeddings", str(POSITIONS), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by",
            "32", "--micro-batch-size", "1", "--global-batch-size", str(BATCH), "--mock-data", "--train-iters",
            str(TRAIN_ITERS), "--lr", str(LR), "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout",
            "0", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--load",
            str(load_dir)]


@pytest.mark.e2e
def test_pretrain_goes_on_from_a_converted_checkpoint(tmp_path):
    from tests.launch import launch
    megatron_deepspeed_checkpoint(tmp_path / "mds", ours(), 1, 2)
    assert convert(tmp_path / "mds", tmp_path / "ours").returncode == 0
    result = launch(2, run_flags(tmp_path / "ours", pp=2))
    assert result.returncode == 0, result.stdout
    assert f"resuming at iteration 5, consumed samples {SAMPLES}" in result.stdout
    assert f" iteration 6/{TRAIN_ITERS} | consumed samples: 96 |" in result.stdout


def our_state(groups=GROUPS):
    """The model of ours() with adam_states' master weights and moments, STEP, the data position and OUR_SCHEDULE,
    as our checkpoints hold them (FullState, fp32)."""
    weights = ours(groups=groups)
    moments = adam_states(weights)
    args = {"num_layers": LAYERS, "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": groups,
            "ffn_hidden_size": FFN, "padded_vocab_size": VOCAB, "vocab_size": VOCAB, "max_position_embeddings":
            POSITIONS, "seq_length": POSITIONS, "normalization": "LayerNorm", "params_dtype": "float32",
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "make_vocab_size_divisible_by": 32,
            "global_batch_size": BATCH, "train_iters": TRAIN_ITERS, "train_samples": None}
    optimizer = {name: {key: moments[key][name] for key in moments} for name in weights}
    return state.FullState(args=args, weights=weights, optimizer=optimizer, optimizer_step=STEP, iteration=ITERATION,
                           consumed_train_samples=SAMPLES, consumed_train_tokens=TOKENS, scheduler=OUR_SCHEDULE)


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """Iterations 6 and 7 of the same model, master weights, moments, step and schedule written directly in our
    format (no Megatron-DeepSpeed file involved), continued at TP 1 x PP 1."""
    from tests.launch import launch, losses
    folder = tmp_path_factory.mktemp("reference")
    state.write_sharded_checkpoint(our_state(), str(folder), 1, 1)
    result = launch(1, run_flags(folder))
    assert result.returncode == 0, result.stdout
    return losses(result.stdout)


@pytest.mark.e2e
@pytest.mark.parametrize("tp, pp, then", [(1, 1, (2, 1)), (1, 2, (2, 1)), (2, 1, (1, 2))],
                         ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_a_converted_checkpoint_continues_as_the_same_state_written_as_ours(tmp_path, reference_losses, tp, pp, then):
    """Its weights, master weights, moments, step and LR schedule converted, continued at its layout and at
    another: iterations 6 and 7 (the first after an Adam step from the carried moments) as the reference's."""
    from tests.launch import launch, losses
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=adam_states(weights))
    assert convert(tmp_path / "mds", tmp_path / "ours").returncode == 0
    for layout in ((tp, pp), then):
        result = launch(layout[0] * layout[1], run_flags(tmp_path / "ours", *layout))
        assert result.returncode == 0, result.stdout
        assert "optimizer states loaded" in result.stdout and "LR schedule the checkpoint's" in result.stdout
        continued = losses(result.stdout)
        assert sorted(continued) == sorted(reference_losses) == [6, 7]
        for iteration, loss in reference_losses.items():
            assert abs(continued[iteration] - loss) <= 1e-5, (layout, iteration, continued, reference_losses)


@pytest.mark.e2e
@pytest.mark.parametrize("tp, pp, then", [(1, 1, (2, 1)), (1, 2, (2, 1)), (2, 1, (1, 2))],
                         ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_pretrain_loads_its_folder_directly(tmp_path, reference_losses, tp, pp, then):
    """--load of its folder, no conversion: at its layout (RNG states restored) and resharded to another,
    iterations 6 and 7 as the reference's."""
    from tests.launch import launch, losses
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=adam_states(weights))
    for layout in ((tp, pp), then):
        result = launch(layout[0] * layout[1], run_flags(tmp_path / "mds", *layout))
        assert result.returncode == 0, result.stdout
        assert f"(Megatron-DeepSpeed checkpoint (version 3.0, TP {tp} x PP {pp} x DP 1)) via" in result.stdout
        assert "optimizer states loaded" in result.stdout and "LR schedule the checkpoint's" in result.stdout
        if layout == (tp, pp):
            assert "resharded" not in result.stdout and "RNG states restored" in result.stdout
        else:
            assert f"resharded to TP {layout[0]} x PP {layout[1]}" in result.stdout
            assert "RNG states not restored (saved at another TP x PP)" in result.stdout
        continued = losses(result.stdout)
        for iteration, loss in reference_losses.items():
            assert abs(continued[iteration] - loss) <= 1e-5, (layout, iteration, continued, reference_losses)


@pytest.mark.e2e
def test_a_version_2_checkpoint_continues_as_the_same_state_written_as_ours(tmp_path):
    """checkpoint_version 2.0 (per head its q, k, v rows; multi-head) at TP 2, --load of its folder at its layout
    and resharded to TP 1 x PP 2: iterations 6 and 7 as the same multi-head state written in our format."""
    from tests.launch import launch, losses
    state.write_sharded_checkpoint(our_state(groups=HEADS), str(tmp_path / "reference"), 1, 1)
    reference = launch(1, run_flags(tmp_path / "reference", groups=HEADS))
    assert reference.returncode == 0, reference.stdout
    weights = ours(groups=HEADS)
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, 2, 1, moments=adam_states(weights), groups=HEADS,
                                  version=2.0)
    for layout in ((2, 1), (1, 2)):
        result = launch(2, run_flags(tmp_path / "mds", *layout, groups=HEADS))
        assert result.returncode == 0, result.stdout
        assert "(Megatron-DeepSpeed checkpoint (version 2.0, TP 2 x PP 1 x DP 1)) via" in result.stdout
        continued = losses(result.stdout)
        assert sorted(continued) == [6, 7]
        for iteration, loss in losses(reference.stdout).items():
            assert abs(continued[iteration] - loss) <= 1e-5, (layout, iteration, continued)


def ds_to_universal(checkpoint, output, tag="global_step5"):
    """DeepSpeed's own converter (python -m deepspeed.checkpoint.ds_to_universal) on checkpoint/tag."""
    return subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(checkpoint / tag), "--output_folder", str(output / f"{tag}_universal")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
@pytest.mark.parametrize("source, target", [((2, 2, 2), (1, 1)), ((1, 2, 1), (2, 1))], ids=["tp2pp2dp2", "tp1pp2"])
def test_a_universal_checkpoint_of_its_origin_continues_as_the_same_state_written_as_ours(
        tmp_path, reference_losses, source, target):
    """Its checkpoint (with universal_checkpoint_info, as it saves) through DeepSpeed's ds_to_universal, then
    --universal-checkpoint --load at another layout: query_key_value's rows (concatenated over its TP shards)
    put in our order, the vocabulary padded again, the moments and step carried: iterations 6 and 7 as the
    reference's."""
    from tests.launch import launch, losses
    weights = ours()
    tp, pp, dp = source
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=adam_states(weights), dp=dp)
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal")
    assert converted.returncode == 0, converted.stdout + converted.stderr
    result = launch(target[0] * target[1], run_flags(tmp_path / "universal", *target) + ["--universal-checkpoint"])
    assert result.returncode == 0, result.stdout
    assert (f"(Megatron-DeepSpeed universal checkpoint (version 3.0, converted from TP {tp} x PP {pp} x DP {dp})) "
            f"via megatron-deepspeed universal files read per rank (weights and optimizer states") in result.stdout
    continued = losses(result.stdout)
    assert sorted(continued) == [6, 7]
    for iteration, loss in reference_losses.items():
        assert abs(continued[iteration] - loss) <= 1e-5, (iteration, continued, reference_losses)


def test_deepspeeds_converter_still_fails_on_its_pp_1_checkpoints(tmp_path):
    """What the README says: DeepSpeed 0.19.8's ds_to_universal cannot read its nested PP 1 `module` (so --load reads
    such a checkpoint directly, or tools/convert_checkpoint.py --from-megatron-deepspeed converts it). When this
    fails, DeepSpeed has fixed it: the README and this test should say so."""
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, 1, 1, moments=adam_states(weights))
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal")
    assert converted.returncode != 0 and "'dict' object has no attribute 'float'" in converted.stderr


# --- the way back: ours -> Megatron-DeepSpeed's format -> ours ---------------------------------------------

def our_checkpoint(folder, tp, pp):
    """our_state() written as our converter writes checkpoints, at TP tp x PP pp."""
    full = our_state()
    full.args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    state.write_sharded_checkpoint(full, str(folder), tp, pp)


def to_megatron_deepspeed(source, target, *flags):
    from megatron_ds.conversion import convert_cli as cli
    return cli.main(["--to-megatron-deepspeed", "--load", str(source), "--save", str(target), *flags])


def _tensors(tree):
    """{dotted key: tensor} of a nested dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": tensor for inner, tensor in _tensors(value).items()})
        elif isinstance(value, torch.Tensor):
            flat[str(key)] = value
    return flat


def assert_written_as_its_layout(written, expected, tp, pp):
    """Every model file of `written` (our writer) holds what `expected` (this file's builder of Megatron-DeepSpeed's
    layout, QKV rows picked head by head) holds: names, nesting, QKV order, ZeRO parameter names in order."""
    layer_files = sorted(path.name for path in expected.glob("layer_*"))
    assert sorted(path.name for path in written.glob("layer_*")) == layer_files
    for name in layer_files + [f"mp_rank_{mp_rank:02d}_model_states.pt" for mp_rank in range(tp * pp)]:
        ours_, theirs = torch.load(written / name, weights_only=False), torch.load(expected / name, weights_only=False)
        if name.startswith("mp_rank_"):
            assert [list(group.items()) for group in ours_["param_shapes"]] == \
                [list(group.items()) for group in theirs["param_shapes"]], name
            assert (ours_["checkpoint_version"], ours_["iteration"], ours_["tokens"]) == (3.0, ITERATION, TOKENS)
            assert {key: ours_["lr_scheduler"][key] for key in theirs["lr_scheduler"] if "wd" not in key} == \
                {key: value for key, value in theirs["lr_scheduler"].items() if "wd" not in key}
            ours_, theirs = ours_["module"] or {}, theirs["module"] or {}
        ours_, theirs = _tensors(ours_), _tensors(theirs)
        assert sorted(ours_) == sorted(theirs), name
        for key, value in theirs.items():
            assert torch.equal(ours_[key], value), (name, key)


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1)], ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_ours_to_its_format_and_back_is_bitwise(tmp_path, tp, pp):
    """Ours written in Megatron-DeepSpeed's format holds what its layout holds (against this file's independent
    builder), and read back as ours gives every weight, master weight, moment, the step, iteration, consumed
    samples, tokens and the LR schedule and its position bit for bit."""
    our_checkpoint(tmp_path / "ours", tp, pp)
    assert to_megatron_deepspeed(tmp_path / "ours", tmp_path / "mds") == 0
    mds = tmp_path / "mds"
    assert (mds / "latest").read_text().strip() == "global_step5"
    assert (mds / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert not list(mds.glob("*.tmp*"))
    original = our_state()
    megatron_deepspeed_checkpoint(tmp_path / "expected", original.weights, tp, pp, moments=adam_states(ours()))
    assert_written_as_its_layout(mds / "global_step5", tmp_path / "expected" / "global_step5", tp, pp)

    from megatron_ds.conversion import convert_cli as cli
    assert cli.main(["--from-megatron-deepspeed", str(mds), "--save", str(tmp_path / "back")]) == 0
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "back"))
    back = state.read_full_state(str(tmp_path / "back" / tag), metadata)
    assert (back.iteration, back.consumed_train_samples, back.consumed_train_tokens, back.scheduler) == \
        (ITERATION, SAMPLES, TOKENS, OUR_SCHEDULE)
    assert back.optimizer_step == STEP and sorted(back.weights) == sorted(original.weights)
    for name, value in original.weights.items():
        assert torch.equal(back.weights[name], value), name
        for key in state.OPTIMIZER_KEYS:
            assert torch.equal(back.optimizer[name][key], original.optimizer[name][key]), (name, key)


def test_its_zero_files_partition_as_deepspeed_over_data_parallel_ranks(tmp_path):
    """--target-data-parallel-size 2 at TP 2 x PP 2: each group's flat padded to a multiple of 2 x DP and cut in
    two, the master weights saved without the padding; read back bitwise."""
    our_checkpoint(tmp_path / "ours", 1, 1)
    assert to_megatron_deepspeed(tmp_path / "ours", tmp_path / "mds", "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-model-parallel-size", "2", "--target-data-parallel-size", "2") == 0
    tag = tmp_path / "mds" / "global_step5"
    saved = [torch.load(tag / f"zero_pp_rank_{replica}_mp_rank_03_optim_states.pt", weights_only=False)
             ["optimizer_state_dict"] for replica in range(2)]
    shapes = torch.load(tag / "mp_rank_03_model_states.pt", weights_only=False)["param_shapes"]
    for group, by_name in enumerate(shapes):
        numel = sum(shape.numel() for shape in by_name.values())
        partition = saved[0]["base_optimizer_state"]["state"][group]["exp_avg"].numel()
        assert partition == -(-numel // 4) * 4 // 2
        assert sum(part["single_partition_of_fp32_groups"][group].numel() for part in saved) == numel
    metadata = megatron_deepspeed.read_metadata(str(tag))
    back = state.read_full_state(str(tag), metadata)
    original = our_state()
    for name, value in original.weights.items():
        assert torch.equal(back.weights[name], value), name
        for key in state.OPTIMIZER_KEYS:
            assert torch.equal(back.optimizer[name][key], original.optimizer[name][key]), (name, key)


@pytest.mark.e2e
def test_pretrain_goes_on_from_ours_written_in_its_format(tmp_path, reference_losses):
    """Ours at TP 1 x PP 2 written in Megatron-DeepSpeed's format at TP 2 x PP 1 and loaded by pretrain.py: iterations
    6 and 7 as continuing ours."""
    from tests.launch import launch, losses
    our_checkpoint(tmp_path / "ours", 1, 2)
    assert to_megatron_deepspeed(tmp_path / "ours", tmp_path / "mds", "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-model-parallel-size", "1") == 0
    result = launch(2, run_flags(tmp_path / "mds", 2, 1))
    assert result.returncode == 0, result.stdout
    assert "(Megatron-DeepSpeed checkpoint (version 3.0, TP 2 x PP 1 x DP 1)) via" in result.stdout
    assert "optimizer states loaded" in result.stdout and "LR schedule the checkpoint's" in result.stdout
    continued = losses(result.stdout)
    assert sorted(continued) == sorted(reference_losses) == [6, 7]
    for iteration, loss in reference_losses.items():
        assert abs(continued[iteration] - loss) <= 1e-5, (iteration, continued, reference_losses)


@pytest.mark.e2e
def test_ours_written_in_its_format_goes_through_deepspeeds_universal_converter(tmp_path, reference_losses):
    """Ours written in its format at TP 2 x PP 2 x DP 2 carries what its saves carry for ds_to_universal
    (universal_checkpoint_info, DeepSpeed's param_slice_mappings and per-group partition counts): DeepSpeed's
    converter runs on it, and --universal-checkpoint --load of the result at TP 1 x PP 1 goes on as ours."""
    from tests.launch import launch, losses
    our_checkpoint(tmp_path / "ours", 1, 1)
    assert to_megatron_deepspeed(tmp_path / "ours", tmp_path / "mds", "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-model-parallel-size", "2", "--target-data-parallel-size", "2") == 0
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal")
    assert converted.returncode == 0, converted.stdout + converted.stderr
    result = launch(1, run_flags(tmp_path / "universal") + ["--universal-checkpoint"])
    assert result.returncode == 0, result.stdout
    assert "converted from TP 2 x PP 2 x DP 2" in result.stdout
    continued = losses(result.stdout)
    for iteration, loss in reference_losses.items():
        assert abs(continued[iteration] - loss) <= 1e-5, (iteration, continued, reference_losses)


LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-key-value-heads", "2",
         "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--lr", "1e-3", "--log-interval", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4"]


@pytest.mark.e2e
def test_a_llama_run_goes_through_its_format_and_deepspeeds_universal_converter(tmp_path):
    """A LLaMA-style run (GQA, SwiGLU, RMSNorm, RoPE, untied, no biases) at TP 2 saved at iteration 2, written in its
    format at TP 2 x PP 2, through ds_to_universal (SwiGLU's halves, the untied head, the replicated norms), loaded at
    TP 1 x PP 2: iterations 3 and 4 as the run's own. Its folder exported by --to-hf: the run's own export."""
    from tests.launch import launch, losses
    straight = launch(2, LLAMA + ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "run"),
                                  "--save-interval", "2"])
    assert straight.returncode == 0, straight.stdout
    assert to_megatron_deepspeed(tmp_path / "run", tmp_path / "mds", "--load-iteration", "2",
                                 "--target-pipeline-model-parallel-size", "2") == 0
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal", "global_step2")
    assert converted.returncode == 0, converted.stdout + converted.stderr
    result = launch(2, LLAMA + ["--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "universal"),
                                "--universal-checkpoint"])
    assert result.returncode == 0, result.stdout
    assert "converted from TP 2 x PP 2 x DP 1" in result.stdout
    expected, continued = losses(straight.stdout), losses(result.stdout)
    assert sorted(continued) == [3, 4]
    for iteration in (3, 4):
        assert continued[iteration] == pytest.approx(expected[iteration], rel=1e-6), (continued, expected)
    # its folder exported to Hugging Face (--to-hf) as the run's own checkpoint is
    from safetensors.torch import load_file

    from megatron_ds.conversion import convert_cli as cli
    for source, target in ((tmp_path / "mds", "from_mds"), (tmp_path / "run", "from_ours")):
        assert cli.main(["--to-hf", "--load", str(source), "--load-iteration", "2", "--save",
                         str(tmp_path / target)]) == 0
    exported, ours_ = (load_file(str(tmp_path / target / "model.safetensors")) for target in ("from_mds", "from_ours"))
    assert sorted(exported) == sorted(ours_) and all(torch.equal(exported[key], ours_[key]) for key in ours_)



# --- Mixture of Experts: DeepSpeed's MoE layer in every layer's MLP, its expert files and expert groups --------

EXPERTS, EP = 4, 2
_EXPERT_MODULES = (("linear_fc1", "dense_h_to_4h"), ("linear_fc2", "dense_4h_to_h"))


def ours_moe(seed=0):
    """ours() with every layer's MLP an MoE layer of EXPERTS experts (a router [experts, h], each expert a GPT-2
    MLP), by canonical name (experts by their global index)."""
    generator = torch.Generator().manual_seed(seed + 7)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    weights = {name: value for name, value in ours(seed).items() if ".mlp.linear_fc" not in name}
    for i in range(LAYERS):
        prefix = f"decoder.layers.{i}.mlp."
        weights[prefix + "deepspeed_moe.gate.wg.weight"] = rand(EXPERTS, H)
        for e in range(EXPERTS):
            weights.update({prefix + f"experts.{e}.linear_fc1.weight": rand(FFN, H),
                            prefix + f"experts.{e}.linear_fc1.bias": rand(FFN),
                            prefix + f"experts.{e}.linear_fc2.weight": rand(H, FFN),
                            prefix + f"experts.{e}.linear_fc2.bias": rand(H)})
    return weights


def _their_expert(i, index, module, kind):
    return f"language_model.encoder.layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{index}.{module}.{kind}"


def megatron_deepspeed_moe_checkpoint(load_dir, weights, moments, dp=2, ep=EP):
    """Its MoE checkpoint at TP 1 x PP 1 x DP dp with EP ep, as DeepSpeed's engine saves one: the nested `module`
    without the experts; one file per MoE layer and global expert, layer_{l}_expert_{e}_mp_rank_00_model_states.pt,
    keyed by the global index; param_shapes and the ZeRO files in its optimizer's four groups (with and without
    weight decay, then the experts' two, named by the local index); an expert group's flat (the local experts of
    expert-parallel rank d % ep) partitioned over the dp / ep ranks of its expert-data-parallel group."""
    tag = load_dir / f"global_step{ITERATION}"
    tag.mkdir(parents=True)
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                              ffn_hidden_size=FFN, padded_vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                              seq_length=POSITIONS, normalization="layernorm", params_dtype=torch.float32,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=dp,
                              data_parallel_size=dp, consumed_train_samples=SAMPLES, consumed_valid_samples=0,
                              global_batch_size=BATCH, micro_batch_size=1, train_iters=TRAIN_ITERS, train_samples=None,
                              zero_stage=1, num_experts=[EXPERTS], moe_expert_parallel_size=ep, expert_interval=1,
                              topk=1, mlp_type="standard")
    named = their_parameters(weights, 1, 0, 0, 1)
    for i in range(LAYERS):
        for e in range(EXPERTS):
            torch.save({_their_expert(i, e, theirs, kind): weights[f"decoder.layers.{i}.mlp.experts.{e}.{ours_}.{kind}"]
                        .clone() for ours_, theirs in _EXPERT_MODULES for kind in ("weight", "bias")},
                       tag / f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt")
    local = EXPERTS // ep
    expert_groups = [[(i, index, theirs, kind) for i in range(LAYERS) for index in range(local)
                      for _, theirs in _EXPERT_MODULES] for kind in ("weight", "bias")]
    groups = [[name for name, value in named.items() if value.dim() == 2],
              [name for name, value in named.items() if value.dim() == 1]]
    shapes = [{name: named[name].shape for name in group} for group in groups]
    shapes += [{_their_expert(i, index, theirs, kind): weights[f"decoder.layers.{i}.mlp.experts.{index}."
                                                               f"{_ours_expert_module(theirs)}.{kind}"].shape
                for i, index, theirs, kind in group} for group in expert_groups]
    torch.save({"module": _module(named), "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "tokens": TOKENS, "buffer_names": [], "lr_scheduler": their_scheduler(), "param_shapes": shapes,
                "rng_state": [their_rng_state(replica) for replica in range(dp)]}, tag / "mp_rank_00_model_states.pt")
    their_moments = {key: their_parameters(values, 1, 0, 0, 1) for key, values in moments.items()}
    for replica in range(dp):
        ep_rank, edp, members = replica % ep, replica // ep, dp // ep
        flats = {key: [_padded(torch.cat([by_name[name].flatten() for name in group]), dp)[replica] for group in groups]
                 for key, by_name in their_moments.items()}
        for key, by_name in moments.items():
            flats[key] += [_padded(torch.cat([by_name[f"decoder.layers.{i}.mlp.experts.{ep_rank * local + index}."
                                                      f"{_ours_expert_module(theirs)}.{kind}"].flatten()
                                              for i, index, theirs, kind in group]), members)[edp]
                           for group in expert_groups]
        count = len(flats["fp32"])
        optimizer = {"zero_stage": 1, "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False,
                     "partition_count": [dp, dp, members, members],
                     "base_optimizer_state": {"state": {index: {"step": torch.tensor(float(STEP)),
                                                                "exp_avg": flats["exp_avg"][index],
                                                                "exp_avg_sq": flats["exp_avg_sq"][index]}
                                                        for index in range(count)}, "param_groups": []},
                     "single_partition_of_fp32_groups": flats["fp32"]}
        torch.save({"optimizer_state_dict": optimizer, "ds_version": "0.19.8"},
                   tag / f"zero_pp_rank_{replica}_mp_rank_00_optim_states.pt")
    (load_dir / "latest").write_text(tag.name)
    (load_dir / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _ours_expert_module(theirs):
    return dict((their, our) for our, their in _EXPERT_MODULES)[theirs]


def _padded(flat, parts):
    return [piece.clone() for piece in torch.nn.functional.pad(flat, (0, -flat.numel() % (4 * parts))).chunk(parts)]


def our_moe_state():
    """(weights, moments, FullState) of ours_moe() with adam_states' moments, STEP, the data position and
    OUR_SCHEDULE, EP EP."""
    weights = ours_moe()
    moments = adam_states(weights)
    full = state.FullState(args={**our_state().args, "num_experts": [EXPERTS], "moe_expert_parallel_size": EP,
                                 "expert_interval": 1},
                           weights=weights, optimizer={name: {key: moments[key][name] for key in moments}
                                                       for name in weights},
                           optimizer_step=STEP, iteration=ITERATION, consumed_train_samples=SAMPLES,
                           consumed_train_tokens=TOKENS, scheduler=OUR_SCHEDULE)
    return weights, moments, full


MOE_FLAGS = ["--num-experts", str(EXPERTS), "--moe-expert-parallel-size", str(EP), "--expert-interval", "1",
             "--disable-moe-token-dropping"]


def test_its_moe_experts_and_their_adam_states_arrive_as_ours(tmp_path):
    """Every expert from its expert files, the router, and the experts' master weights and moments cut from each
    expert-parallel rank's expert-data-parallel partitions, named by their global index: exactly what was built."""
    weights = ours_moe()
    moments = adam_states(weights)
    megatron_deepspeed_moe_checkpoint(tmp_path / "mds", weights, moments)
    assert convert(tmp_path / "mds", tmp_path / "ours").returncode == 0
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "ours"))
    full = state.read_full_state(str(tmp_path / "ours" / tag), metadata)
    assert sorted(full.weights) == sorted(weights) and full.optimizer_step == STEP
    for name, value in weights.items():
        assert torch.equal(full.weights[name], value), name
        for key in moments:
            assert torch.equal(full.optimizer[name][key], moments[key][name]), (key, name)


@pytest.mark.e2e
def test_its_moe_checkpoint_continues_as_the_same_state_written_as_ours(tmp_path):
    """Its MoE checkpoint (DP 2, EP 2) --load'ed directly at its layout and resharded to PP 2 x DP 2 (EP 2):
    iterations 6 and 7 as the same state written in our format. No token is dropped (MOE_FLAGS): which tokens
    DeepSpeed's router keeps over capacity is drawn at random (its random token selection), and one process and two
    pipeline stages, or restored and fresh RNG states, draw differently."""
    from tests.launch import launch, losses
    weights, moments, full = our_moe_state()
    state.write_sharded_checkpoint(full, str(tmp_path / "reference"), 1, 1)
    reference = launch(2, run_flags(tmp_path / "reference") + MOE_FLAGS)
    assert reference.returncode == 0, reference.stdout
    megatron_deepspeed_moe_checkpoint(tmp_path / "mds", weights, moments)
    for tp, pp, ranks in ((1, 1, 2), (1, 2, 4)):
        result = launch(ranks, run_flags(tmp_path / "mds", tp, pp) + MOE_FLAGS)
        assert result.returncode == 0, result.stdout
        assert "(Megatron-DeepSpeed checkpoint (version 3.0, TP 1 x PP 1 x DP 2)) via" in result.stdout
        assert "optimizer states loaded" in result.stdout
        continued = losses(result.stdout)
        assert sorted(continued) == [6, 7]
        for iteration, loss in losses(reference.stdout).items():
            assert abs(continued[iteration] - loss) <= 1e-5, ((tp, pp), iteration, continued)


def test_our_moe_written_in_its_format_is_its_layout_and_reads_back_bitwise(tmp_path):
    """The way back with experts: ours written at TP 1 x PP 1 x DP 2 (EP 2) holds what this file's builder of its MoE
    layout holds (module, expert files, param_shapes in its four groups, each replica's ZeRO partitions of the
    expert groups), and reads back as ours bit for bit."""
    weights, moments, full = our_moe_state()
    megatron_deepspeed.write_checkpoint(full, str(tmp_path / "written"), 1, 1, dp=2)
    megatron_deepspeed_moe_checkpoint(tmp_path / "expected", weights, moments)
    written, expected = tmp_path / "written" / "global_step5", tmp_path / "expected" / "global_step5"
    assert sorted(p.name for p in written.glob("layer_*")) == sorted(p.name for p in expected.glob("layer_*"))
    for path in expected.glob("layer_*"):
        ours_, theirs = torch.load(written / path.name), torch.load(path)
        assert sorted(ours_) == sorted(theirs) and all(torch.equal(ours_[k], v) for k, v in theirs.items()), path.name
    ours_, theirs = (torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
                     for folder in (written, expected))
    assert [list(group.items()) for group in ours_["param_shapes"]] == \
        [list(group.items()) for group in theirs["param_shapes"]]
    assert sorted(_tensors(ours_["module"])) == sorted(_tensors(theirs["module"]))
    for replica in range(2):
        name = f"zero_pp_rank_{replica}_mp_rank_00_optim_states.pt"
        ours_, theirs = (torch.load(folder / name, weights_only=False)["optimizer_state_dict"]
                         for folder in (written, expected))
        for group in (2, 3):   # the expert groups: expert-parallel rank replica % EP's experts (unpadded)
            master = ours_["single_partition_of_fp32_groups"][group]
            assert torch.equal(master, theirs["single_partition_of_fp32_groups"][group][:master.numel()])
            moment = ours_["base_optimizer_state"]["state"][group]["exp_avg"][:master.numel()]
            assert torch.equal(moment, theirs["base_optimizer_state"]["state"][group]["exp_avg"][:master.numel()])
    back = state.read_full_state(str(written), megatron_deepspeed.read_metadata(str(written)))
    assert sorted(back.weights) == sorted(weights) and back.optimizer_step == STEP
    for name, value in weights.items():
        assert torch.equal(back.weights[name], value), name
        for key in moments:
            assert torch.equal(back.optimizer[name][key], moments[key][name]), (key, name)
