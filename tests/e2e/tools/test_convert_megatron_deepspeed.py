"""pretrain.py going on from Megatron-DeepSpeed's checkpoints (built by
tests/support/megatron_deepspeed_checkpoints.py) converted, --load'ed directly, or through DeepSpeed's universal
converter, and from ours written in its format: the losses of the same state written as ours."""
import pytest
import torch

from megatron_ds.checkpointing import state
from tests.support.launch import assert_succeeded
from tests.support.megatron_deepspeed_checkpoints import (
    BATCH,
    EP,
    EXPERTS,
    FFN,
    GROUPS,
    HEADS,
    LAYERS,
    LR,
    POSITIONS,
    SAMPLES,
    TRAIN_ITERS,
    VOCAB,
    H,
    adam_states,
    convert,
    ds_to_universal,
    megatron_deepspeed_checkpoint,
    megatron_deepspeed_moe_checkpoint,
    our_checkpoint,
    our_moe_state,
    our_state,
    ours,
    to_megatron_deepspeed,
)


def run_flags(load_dir, tp=1, pp=1, groups=GROUPS):
    return ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
            "--num-key-value-heads", str(groups), "--ffn-hidden-size", str(FFN), "--seq-length", str(POSITIONS),
            "--max-position-embeddings", str(POSITIONS), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by",
            "32", "--micro-batch-size", "1", "--global-batch-size", str(BATCH), "--mock-data", "--train-iters",
            str(TRAIN_ITERS), "--lr", str(LR), "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout",
            "0", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--load",
            str(load_dir)]


def test_pretrain_goes_on_from_a_converted_checkpoint(tmp_path):
    from tests.support.launch import launch
    megatron_deepspeed_checkpoint(tmp_path / "mds", ours(), 1, 2)
    assert convert(tmp_path / "mds", tmp_path / "ours").returncode == 0
    result = launch(2, run_flags(tmp_path / "ours", pp=2))
    assert_succeeded(result, tail=None)
    assert f"resuming at iteration 5, consumed samples {SAMPLES}" in result.stdout
    assert f" iteration 6/{TRAIN_ITERS} | consumed samples: 96 |" in result.stdout


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """Iterations 6 and 7 of the same model, master weights, moments, step and schedule written directly in our
    format (no Megatron-DeepSpeed file involved), continued at TP 1 x PP 1."""
    from tests.support.launch import launch, losses
    folder = tmp_path_factory.mktemp("reference")
    state.write_sharded_checkpoint(our_state(), str(folder), 1, 1)
    result = launch(1, run_flags(folder))
    assert_succeeded(result, tail=None)
    return losses(result.stdout)


@pytest.mark.parametrize("tp, pp, then", [(1, 1, (2, 1)), (1, 2, (2, 1)), (2, 1, (1, 2))],
                         ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_a_converted_checkpoint_continues_as_the_same_state_written_as_ours(tmp_path, reference_losses, tp, pp, then):
    """Its weights, master weights, moments, step and LR schedule converted, continued at its layout and at
    another: iterations 6 and 7 (the first after an Adam step from the carried moments) as the reference's."""
    from tests.support.launch import launch, losses
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=adam_states(weights))
    assert convert(tmp_path / "mds", tmp_path / "ours").returncode == 0
    for layout in ((tp, pp), then):
        result = launch(layout[0] * layout[1], run_flags(tmp_path / "ours", *layout))
        assert_succeeded(result, tail=None)
        assert "optimizer states loaded" in result.stdout and "LR schedule the checkpoint's" in result.stdout
        continued = losses(result.stdout)
        assert sorted(continued) == sorted(reference_losses) == [6, 7]
        for iteration, loss in reference_losses.items():
            assert abs(continued[iteration] - loss) <= 1e-5, (layout, iteration, continued, reference_losses)


@pytest.mark.parametrize("tp, pp, then", [(1, 1, (2, 1)), (1, 2, (2, 1)), (2, 1, (1, 2))],
                         ids=["tp1pp1", "tp1pp2", "tp2pp1"])
def test_pretrain_loads_its_folder_directly(tmp_path, reference_losses, tp, pp, then):
    """--load of its folder, no conversion: at its layout (RNG states restored) and resharded to another,
    iterations 6 and 7 as the reference's."""
    from tests.support.launch import launch, losses
    weights = ours()
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=adam_states(weights))
    for layout in ((tp, pp), then):
        result = launch(layout[0] * layout[1], run_flags(tmp_path / "mds", *layout))
        assert_succeeded(result, tail=None)
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


def test_a_version_2_checkpoint_continues_as_the_same_state_written_as_ours(tmp_path):
    """checkpoint_version 2.0 (per head its q, k, v rows; multi-head) at TP 2, --load of its folder at its layout
    and resharded to TP 1 x PP 2: iterations 6 and 7 as the same multi-head state written in our format."""
    from tests.support.launch import launch, losses
    state.write_sharded_checkpoint(our_state(groups=HEADS), str(tmp_path / "reference"), 1, 1)
    reference = launch(1, run_flags(tmp_path / "reference", groups=HEADS))
    assert_succeeded(reference, tail=None)
    weights = ours(groups=HEADS)
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, 2, 1, moments=adam_states(weights), groups=HEADS,
                                  version=2.0)
    for layout in ((2, 1), (1, 2)):
        result = launch(2, run_flags(tmp_path / "mds", *layout, groups=HEADS))
        assert_succeeded(result, tail=None)
        assert "(Megatron-DeepSpeed checkpoint (version 2.0, TP 2 x PP 1 x DP 1)) via" in result.stdout
        continued = losses(result.stdout)
        assert sorted(continued) == [6, 7]
        for iteration, loss in losses(reference.stdout).items():
            assert abs(continued[iteration] - loss) <= 1e-5, (layout, iteration, continued)


@pytest.mark.parametrize("source, target", [((2, 2, 2), (1, 1)), ((1, 2, 1), (2, 1))], ids=["tp2pp2dp2", "tp1pp2"])
def test_a_universal_checkpoint_of_its_origin_continues_as_the_same_state_written_as_ours(
        tmp_path, reference_losses, source, target):
    """Its checkpoint (with universal_checkpoint_info, as it saves) through DeepSpeed's ds_to_universal, then
    --universal-checkpoint --load at another layout: query_key_value's rows (concatenated over its TP shards)
    put in our order, the vocabulary padded again, the moments and step carried: iterations 6 and 7 as the
    reference's."""
    from tests.support.launch import launch, losses
    weights = ours()
    tp, pp, dp = source
    megatron_deepspeed_checkpoint(tmp_path / "mds", weights, tp, pp, moments=adam_states(weights), dp=dp)
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal")
    assert_succeeded(converted, tail=None)
    result = launch(target[0] * target[1], run_flags(tmp_path / "universal", *target) + ["--universal-checkpoint"])
    assert_succeeded(result, tail=None)
    assert (f"(Megatron-DeepSpeed universal checkpoint (version 3.0, converted from TP {tp} x PP {pp} x DP {dp})) "
            f"via megatron-deepspeed universal files read per rank (weights and optimizer states") in result.stdout
    continued = losses(result.stdout)
    assert sorted(continued) == [6, 7]
    for iteration, loss in reference_losses.items():
        assert abs(continued[iteration] - loss) <= 1e-5, (iteration, continued, reference_losses)


def test_pretrain_goes_on_from_ours_written_in_its_format(tmp_path, reference_losses):
    """Ours at TP 1 x PP 2 written in Megatron-DeepSpeed's format at TP 2 x PP 1 and loaded by pretrain.py: iterations
    6 and 7 as continuing ours."""
    from tests.support.launch import launch, losses
    our_checkpoint(tmp_path / "ours", 1, 2)
    assert to_megatron_deepspeed(tmp_path / "ours", tmp_path / "mds", "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-model-parallel-size", "1") == 0
    result = launch(2, run_flags(tmp_path / "mds", 2, 1))
    assert_succeeded(result, tail=None)
    assert "(Megatron-DeepSpeed checkpoint (version 3.0, TP 2 x PP 1 x DP 1)) via" in result.stdout
    assert "optimizer states loaded" in result.stdout and "LR schedule the checkpoint's" in result.stdout
    continued = losses(result.stdout)
    assert sorted(continued) == sorted(reference_losses) == [6, 7]
    for iteration, loss in reference_losses.items():
        assert abs(continued[iteration] - loss) <= 1e-5, (iteration, continued, reference_losses)


def test_ours_written_in_its_format_goes_through_deepspeeds_universal_converter(tmp_path, reference_losses):
    """Ours written in its format at TP 2 x PP 2 x DP 2 carries what its saves carry for ds_to_universal
    (universal_checkpoint_info, DeepSpeed's param_slice_mappings and per-group partition counts): DeepSpeed's
    converter runs on it, and --universal-checkpoint --load of the result at TP 1 x PP 1 goes on as ours."""
    from tests.support.launch import launch, losses
    our_checkpoint(tmp_path / "ours", 1, 1)
    assert to_megatron_deepspeed(tmp_path / "ours", tmp_path / "mds", "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-model-parallel-size", "2", "--target-data-parallel-size", "2") == 0
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal")
    assert_succeeded(converted, tail=None)
    result = launch(1, run_flags(tmp_path / "universal") + ["--universal-checkpoint"])
    assert_succeeded(result, tail=None)
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


def test_a_llama_run_goes_through_its_format_and_deepspeeds_universal_converter(tmp_path):
    """A LLaMA-style run (GQA, SwiGLU, RMSNorm, RoPE, untied, no biases) at TP 2 saved at iteration 2, written in its
    format at TP 2 x PP 2, through ds_to_universal (SwiGLU's halves, the untied head, the replicated norms), loaded at
    TP 1 x PP 2: iterations 3 and 4 as the run's own. Its folder exported by --to-hf: the run's own export."""
    from tests.support.launch import launch, losses
    straight = launch(2, LLAMA + ["--tensor-model-parallel-size", "2", "--save", str(tmp_path / "run"),
                                  "--save-interval", "2"])
    assert_succeeded(straight, tail=None)
    assert to_megatron_deepspeed(tmp_path / "run", tmp_path / "mds", "--load-iteration", "2",
                                 "--target-pipeline-model-parallel-size", "2") == 0
    converted = ds_to_universal(tmp_path / "mds", tmp_path / "universal", "global_step2")
    assert_succeeded(converted, tail=None)
    result = launch(2, LLAMA + ["--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "universal"),
                                "--universal-checkpoint"])
    assert_succeeded(result, tail=None)
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


MOE_FLAGS = ["--num-experts", str(EXPERTS), "--moe-expert-parallel-size", str(EP), "--expert-interval", "1",
             "--disable-moe-token-dropping"]


def test_its_moe_checkpoint_continues_as_the_same_state_written_as_ours(tmp_path):
    """Its MoE checkpoint (DP 2, EP 2) --load'ed directly at its layout and resharded to PP 2 x DP 2 (EP 2):
    iterations 6 and 7 as the same state written in our format. No token is dropped (MOE_FLAGS): which tokens
    DeepSpeed's router keeps over capacity is drawn at random (its random token selection), and one process and two
    pipeline stages, or restored and fresh RNG states, draw differently."""
    from tests.support.launch import launch, losses
    weights, moments, full = our_moe_state()
    state.write_sharded_checkpoint(full, str(tmp_path / "reference"), 1, 1)
    reference = launch(2, run_flags(tmp_path / "reference") + MOE_FLAGS)
    assert_succeeded(reference, tail=None)
    megatron_deepspeed_moe_checkpoint(tmp_path / "mds", weights, moments)
    for tp, pp, ranks in ((1, 1, 2), (1, 2, 4)):
        result = launch(ranks, run_flags(tmp_path / "mds", tp, pp) + MOE_FLAGS)
        assert_succeeded(result, tail=None)
        assert "(Megatron-DeepSpeed checkpoint (version 3.0, TP 1 x PP 1 x DP 2)) via" in result.stdout
        assert "optimizer states loaded" in result.stdout
        continued = losses(result.stdout)
        assert sorted(continued) == [6, 7]
        for iteration, loss in losses(reference.stdout).items():
            assert abs(continued[iteration] - loss) <= 1e-5, ((tp, pp), iteration, continued)
