"""Checkpoints in Megatron-DeepSpeed's format, written here by code that follows its file layout
(checkpointing/foreign/megatron_deepspeed.py's docstring; Megatron-DeepSpeed is not vendored), its query_key_value
rows built head by head from what each row means; our state of the same model; the converters run on them."""
import argparse
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from megatron_ds.checkpointing import state

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


OUR_SCHEDULE = {"schedule": {"max_lr": LR, "min_lr": 0.0, "decay_style": "linear", "warmup": 0,
                              "warmup_unit": "iterations", "decay": TRAIN_ITERS, "decay_unit": "iterations"},
                 "position": {"iterations": ITERATION, "samples": SAMPLES, "tokens": TOKENS}}


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


def ds_to_universal(checkpoint, output, tag="global_step5"):
    """DeepSpeed's own converter (python -m deepspeed.checkpoint.ds_to_universal) on checkpoint/tag."""
    return subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(checkpoint / tag), "--output_folder", str(output / f"{tag}_universal")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


# --- the way back: ours -> Megatron-DeepSpeed's format -> ours ---------------------------------------------

def our_checkpoint(folder, tp, pp):
    """our_state() written as our converter writes checkpoints, at TP tp x PP pp."""
    full = our_state()
    full.args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    state.write_sharded_checkpoint(full, str(folder), tp, pp)


def to_megatron_deepspeed(source, target, *flags):
    from megatron_ds.conversion import convert_cli as cli
    return cli.main(["--to-megatron-deepspeed", "--load", str(source), "--save", str(target), *flags])


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
