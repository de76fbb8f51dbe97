"""tools/convert_checkpoint.py --from-megatron-deepspeed and --to-megatron-deepspeed: checkpoints built in
Megatron-DeepSpeed's format by tests/support/megatron_deepspeed_checkpoints.py (code that follows its file layout;
Megatron-DeepSpeed is not vendored) converted and read back as ours, and ours written in its format as that layout
holds it. pretrain.py going on from them: tests/e2e/tools/test_convert_megatron_deepspeed.py."""
import pytest
import torch

from megatron_ds.checkpointing import discovery, files, state
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.checkpointing.foreign.megatron_deepspeed import qkv_in_our_order
from tests.support.launch import assert_succeeded
from tests.support.megatron_deepspeed_checkpoints import (
    GROUPS,
    ITERATION,
    LAYERS,
    OUR_SCHEDULE,
    POSITION,
    SAMPLES,
    STEP,
    TOKENS,
    VOCAB,
    WORD,
    adam_states,
    convert,
    ds_to_universal,
    megatron_deepspeed_checkpoint,
    megatron_deepspeed_moe_checkpoint,
    our_checkpoint,
    our_moe_state,
    our_state,
    ours,
    ours_moe,
    to_megatron_deepspeed,
)


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1)], ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_its_weights_iteration_and_samples_arrive_as_ours(tmp_path, tp, pp):
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp)
    result = convert(tmp_path / "mds", tmp_path / "ours", "--target-tensor-parallel-size", "2",
                     "--target-pipeline-model-parallel-size", "2")
    assert_succeeded(result, tail=None)
    assert f"from Megatron-DeepSpeed's {tmp_path / 'mds' / 'global_step5'} (TP {tp} x PP {pp})" in result.stdout
    tag, metadata, _ = discovery.resolve_checkpoint(str(tmp_path / "ours"))
    assert (tag, metadata["iteration"], metadata["consumed_train_samples"]) == ("global_step5", 5, 80)
    full = state.read_full_state(str(tmp_path / "ours" / tag), metadata, with_optimizer=False)
    assert sorted(full.weights) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(full.weights[name], value), name
    assert full.model["num_key_value_heads"] == GROUPS and full.model["normalization"] == "LayerNorm"


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
    assert_succeeded(result, tail=None)
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


def test_deepspeeds_converter_still_fails_on_its_pp_1_checkpoints(tmp_path):
    """What the README says: DeepSpeed 0.19.8's ds_to_universal cannot read its nested PP 1 `module` (so --load reads
    such a checkpoint directly, or tools/convert_checkpoint.py --from-megatron-deepspeed converts it). When this
    fails, DeepSpeed has fixed it: the README and this test should say so."""
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, 1, 1, moments=adam_states(weights))
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal")
    assert converted.returncode != 0 and "'dict' object has no attribute 'float'" in converted.stderr


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
    """Every model file of `written` (our writer) holds what `expected` (megatron_deepspeed_checkpoints.py's builder
    of Megatron-DeepSpeed's layout, QKV rows picked head by head) holds: names, nesting, QKV order, ZeRO parameter
    names in order."""
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
    """Ours written in Megatron-DeepSpeed's format holds what its layout holds (against
    megatron_deepspeed_checkpoints.py's independent builder), and read back as ours gives every weight, master
    weight, moment, the step, iteration, consumed samples, tokens and the LR schedule and its position bit for
    bit."""
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


def test_our_moe_written_in_its_format_is_its_layout_and_reads_back_bitwise(tmp_path):
    """The way back with experts: ours written at TP 1 x PP 1 x DP 2 (EP 2) holds what
    megatron_deepspeed_checkpoints.py's builder of its MoE layout holds (module, expert files, param_shapes in its
    four groups, each replica's ZeRO partitions of the expert groups), and reads back as ours bit for bit."""
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
