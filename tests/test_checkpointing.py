"""Checkpoints in training, through the real launcher: a resumed run repeats the uninterrupted one bit for
bit (fp32, dropout on), a save killed with SIGKILL at any phase leaves the previous checkpoint published
and loadable, SIGTERM saves and exits; plus the messages of --load for damaged checkpoints, a different
model shape and a different TP/PP (in process)."""
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import psutil
import pytest
import torch

from megatron_ds.conversion import files, state
from tests.launch import BIN, LOSS_LINE, REPO, launch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "100",
        "--lr", "2e-3", "--log-interval", "1", "--seed", "11"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2", "--ffn-hidden-size", "64"]
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _layout_flags(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--make-vocab-size-divisible-by", str(128 // tp)]


def _printed(output):
    """{iteration: the lm loss exactly as printed} and the same for validation losses."""
    return dict(LOSS_LINE.findall(output)), dict(VALIDATION_LINE.findall(output))


def _run(nproc, flags):
    result = launch(nproc, flags, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


def _full_state(folder):
    return state.read_full_state(folder, files.read_metadata(folder))


@pytest.mark.parametrize("family,tp,pp,dp", [("gpt2", 2, 2, 1), ("llama", 1, 1, 2)],
                         ids=["gpt2-tp2-pp2-dp1", "llama-tp1-pp1-dp2"])
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path, family, tp, pp, dp):
    """8 iterations straight (saving at 4 and 8) vs a new process that loads iteration 4 and trains 5-8:
    every printed lm loss (and validation loss) is identical, and so is every saved tensor at iteration 8
    (weights, fp32 master weights, Adam moments)."""
    flags = TINY + (LLAMA if family == "llama" else []) + _layout_flags(tp, pp) + [
        "--train-iters", "8", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--eval-interval", "4", "--eval-iters", "1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = _run(tp * pp * dp, flags + ["--save", str(straight), "--save-interval", "4"])
    second = _run(tp * pp * dp, flags + ["--load", str(straight), "--load-iteration", "4", "--save", str(resumed)])

    assert "RNG states restored" in second and "resuming at iteration 4, consumed samples 16" in second, second
    (losses, validation), (resumed_losses, resumed_validation) = _printed(first), _printed(second)
    assert sorted(map(int, losses)) == list(range(1, 9)) and sorted(map(int, resumed_losses)) == [5, 6, 7, 8]
    assert {i: losses[i] for i in resumed_losses} == resumed_losses, (losses, resumed_losses)
    assert resumed_validation == {"8": validation["8"]}, (validation, resumed_validation)
    assert len(set(losses.values())) > 1  # dropout and learning make every iteration different

    expected, observed = _full_state(straight / "global_step8"), _full_state(resumed / "global_step8")
    assert expected.optimizer_step == observed.optimizer_step == 8
    for name, tensor in expected.weights.items():
        assert torch.equal(tensor, observed.weights[name]), name
        for key in state.OPTIMIZER_KEYS:
            assert torch.equal(expected.optimizer[name][key], observed.optimizer[name][key]), (name, key)
    metadata = files.read_metadata(resumed / "global_step8")
    assert (metadata["iteration"], metadata["consumed_train_samples"], metadata["consumed_valid_samples"]) == \
        (8, 32, 8)
    assert (resumed / files.MEGATRON_TRACKER).read_text().strip() == "8"
    assert (resumed / files.DEEPSPEED_POINTER).read_text().strip() == "global_step8"
    assert (resumed / "global_step8" / files.DS_CONFIG_FILE).is_file()


# --- killed saves -----------------------------------------------------------------------------------

class _Job:
    """pretrain.py under torchrun in the background, its output collected line by line."""

    def __init__(self, nproc, flags, env=None):
        from tests.distributed import free_port
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
                   "pretrain.py", *flags]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self):
        return "".join(self.lines)

    def wait_for(self, text, timeout=240):
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if time.monotonic() > deadline or (self.process.poll() is not None and not self._reader.is_alive()):
                self.kill()
                raise AssertionError(f"{text!r} did not appear:\n{self.output[-5000:]}")
            time.sleep(0.1)

    def kill(self):
        """SIGKILL torchrun and every rank (the ranks run in their own sessions)."""
        try:
            family = [psutil.Process(self.process.pid)]
            family += family[0].children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        for process in family:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=60)
        self._reader.join(timeout=10)


KILL_FLAGS = TINY + _layout_flags(1, 2) + ["--train-iters", "6", "--save-interval", "2", "--eval-interval", "0",
                                           "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _kill_during_save(save_dir, phase):
    """Train with saves every 2 iterations; hold the save of iteration 4 at `phase`, then SIGKILL everything."""
    job = _Job(2, KILL_FLAGS + ["--save", str(save_dir)], env={"MEGATRON_DS_TEST_SAVE_PAUSE": f"{phase}@4"})
    job.wait_for(f"test pause in checkpoint save at {phase}@4")
    job.kill()


def _assert_previous_checkpoint_published(save_dir):
    assert files.read_pointer(save_dir) == "global_step2"
    assert (save_dir / files.MEGATRON_TRACKER).read_text().strip() == "2"
    assert (save_dir / files.DEEPSPEED_POINTER).read_text().strip() == "global_step2"
    tag, metadata, notes = files.resolve_checkpoint(str(save_dir))
    assert (tag, metadata["iteration"]) == ("global_step2", 2)
    assert not files.problems_of(str(save_dir / "global_step2"))
    return notes


@pytest.fixture(scope="module")
def killed_in_deepspeed_files(tmp_path_factory):
    """Killed right after DeepSpeed wrote its files of iteration 4 into the temporary folder."""
    save_dir = tmp_path_factory.mktemp("killed")
    _kill_during_save(save_dir, "deepspeed-files")
    return save_dir


def test_save_killed_after_deepspeed_wrote_its_files_leaves_the_previous_checkpoint(killed_in_deepspeed_files):
    save_dir = killed_in_deepspeed_files
    notes = _assert_previous_checkpoint_published(save_dir)
    assert any(name.startswith("zero_pp_rank") for name in os.listdir(save_dir / "global_step4.tmp"))
    assert not (save_dir / "global_step4").exists()
    assert any("global_step4.tmp" in note for note in notes), notes
    _full_state(save_dir / "global_step2")  # every file of it reads


def test_save_killed_after_publishing_the_folder_keeps_the_pointers(tmp_path):
    """Killed after the rename, before the pointers moved: the new folder is complete but not loaded."""
    _kill_during_save(tmp_path, "pointers")
    notes = _assert_previous_checkpoint_published(tmp_path)
    assert any("global_step4 is newer" in note and "it is complete" in note for note in notes), notes
    assert not files.problems_of(str(tmp_path / "global_step4"))


@pytest.mark.parametrize("phase", ["metadata", "between-pointers"])
def test_writer_killed_at_the_other_phases(tmp_path, phase):
    """The publishing steps are shared by training saves and the converter; killing a converter-style writer
    (a small process) at the remaining phases: before the rename, and between Megatron's and DeepSpeed's
    pointer (the new checkpoint is complete there, and the newer pointer names it)."""
    _tiny_checkpoint(tmp_path, 2)
    code = ("import sys; sys.path.insert(0, {repo!r}); from tests.test_checkpointing import _tiny_checkpoint; "
            "_tiny_checkpoint({path!r}, 4)").format(repo=str(REPO), path=str(tmp_path))
    process = subprocess.Popen([str(BIN / "python"), "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "MEGATRON_DS_TEST_SAVE_PAUSE": f"{phase}@4"})
    for line in process.stdout:
        if f"test pause in checkpoint save at {phase}@4" in line:
            break
    process.kill()
    process.wait()
    if phase == "metadata":
        _assert_previous_checkpoint_published(tmp_path)
        assert files.problems_of(str(tmp_path / "global_step4.tmp")) == []  # complete, but never renamed
        return
    assert (tmp_path / files.MEGATRON_TRACKER).read_text().strip() == "4"
    assert (tmp_path / files.DEEPSPEED_POINTER).read_text().strip() == "global_step2"
    tag, _, _ = files.resolve_checkpoint(str(tmp_path))
    assert tag == "global_step4" and not files.problems_of(str(tmp_path / tag))
    assert not files.problems_of(str(tmp_path / "global_step2"))


def test_killed_save_resumes_from_the_previous_checkpoint_and_sigterm_saves(killed_in_deepspeed_files, tmp_path):
    """After the SIGKILL in the middle of a save, pretrain.py --load resumes from the previous checkpoint
    (the stale temporary folder is ignored, then removed); with --exit-signal-handler a SIGTERM sent to the
    launcher makes the ranks finish the iteration, save and exit."""
    save_dir = tmp_path / "run"
    shutil.copytree(killed_in_deepspeed_files, save_dir)
    flags = list(KILL_FLAGS)
    flags[flags.index("--train-iters") + 1] = "100000"
    job = _Job(2, flags + ["--save", str(save_dir), "--load", str(save_dir), "--exit-signal-handler"])
    job.wait_for(" iteration 5/100000 |")
    job.process.send_signal(signal.SIGTERM)
    job.process.wait(timeout=120)
    job._reader.join(timeout=10)
    output = job.output
    assert "loaded checkpoint" in output and "global_step2" in output and "resuming at iteration 2" in output
    assert "ignoring incomplete save(s) global_step4.tmp" in output, output[-4000:]
    exited = re.search(r"exiting at iteration (\d+): a rank received SIGTERM \(checkpoint saved\)", output)
    assert exited, output[-4000:]
    last = exited.group(1)
    assert f" iteration {last}/100000 |" in output and f" iteration {int(last) + 1}/100000 |" not in output
    assert files.read_pointer(save_dir) == f"global_step{last}"
    assert not files.problems_of(str(save_dir / f"global_step{last}"))
    assert not (save_dir / "global_step4.tmp").exists()


# --- --load messages (in process) ---------------------------------------------------------------------

def _tiny_checkpoint(save_dir, iteration, tp=1, pp=1, **model):
    """A sharded checkpoint of a random tiny GPT-2 style model, written without training."""
    from megatron_ds.arguments import parse_args
    from megatron_ds.conversion import files as f
    args = parse_args(TINY + ["--train-iters", "8", *sum(([f"--{k.replace('_', '-')}", str(v)]
                                                         for k, v in model.items()), [])] + _layout_flags(tp, pp),
                      world_size=tp * pp)
    torch.manual_seed(iteration)
    args_dict = f.args_to_dict(args)
    weights = _random_weights(args)
    full = state.FullState(args=args_dict, weights=weights, iteration=iteration,
                           consumed_train_samples=iteration * args.global_batch_size)
    return state.write_sharded_checkpoint(full, str(save_dir), tp, pp, with_optimizer=False), args


def _random_weights(args):
    h, v, ffn = args.hidden_size, args.padded_vocab_size, 4 * args.hidden_size
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


def test_damaged_or_incomplete_newest_checkpoint_names_the_last_good_one(tmp_path):
    _tiny_checkpoint(tmp_path, 2)
    _tiny_checkpoint(tmp_path, 4)
    shard = tmp_path / "global_step4" / files.sharded_file_name(0, 0)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk or a half-finished copy
    with pytest.raises(files.CheckpointError) as damaged:
        files.resolve_checkpoint(str(tmp_path))
    message = str(damaged.value)
    assert "global_step4 is damaged or incomplete" in message and "bytes" in message
    assert f"the last good checkpoint is {tmp_path / 'global_step2'} (iteration 2)" in message
    assert "--load-iteration 2" in message
    assert files.resolve_checkpoint(str(tmp_path), 2)[0] == "global_step2"

    (tmp_path / "global_step4" / files.METADATA_FILE).unlink()  # a save that never finished
    with pytest.raises(files.CheckpointError, match="no megatron_ds_checkpoint.json .*--load-iteration 2"):
        files.resolve_checkpoint(str(tmp_path))
    assert files.resolve_checkpoint(str(tmp_path / "nothing_here"))[0] is None  # nothing yet: from scratch


def _manager_for(args):
    from megatron_ds.checkpointing import CheckpointManager
    manager = CheckpointManager.__new__(CheckpointManager)
    manager.args = args
    return manager


def test_load_refuses_another_model_shape_listing_every_difference(tmp_path):
    from megatron_ds.arguments import parse_args
    folder, _ = _tiny_checkpoint(tmp_path, 2)
    args = parse_args(TINY + ["--train-iters", "8", "--hidden-size", "64", "--num-layers", "3", "--normalization",
                              "RMSNorm", "--load", str(tmp_path)] + _layout_flags(1, 1), world_size=1)
    with pytest.raises(files.CheckpointError) as error:
        _manager_for(args)._check_compatible(folder, files.read_metadata(folder))
    message = str(error.value)
    for expected in ("--num-layers: checkpoint 2, flags 3", "--hidden-size: checkpoint 32, flags 64",
                     "--normalization: checkpoint LayerNorm, flags RMSNorm",
                     "model family: checkpoint gpt2, flags custom"):
        assert expected in message, message


def test_load_with_another_tp_or_pp_points_to_the_converter(tmp_path):
    from megatron_ds.arguments import parse_args
    folder, _ = _tiny_checkpoint(tmp_path, 2, tp=2, pp=1)
    args = parse_args(TINY + ["--train-iters", "8", "--load", str(tmp_path)] + _layout_flags(1, 2), world_size=2)
    with pytest.raises(files.CheckpointError) as error:
        _manager_for(args)._check_compatible(folder, files.read_metadata(folder))
    message = str(error.value)
    assert "--tensor-model-parallel-size 2 and --pipeline-model-parallel-size 1; this run has 1 and 2" in message
    assert (f"python tools/convert_checkpoint.py --load {tmp_path} --save {tmp_path}_tp1_pp2 "
            f"--target-tensor-parallel-size 1 --target-pipeline-model-parallel-size 2") in message


def test_checkpoint_flags_are_validated_before_any_process_group():
    from megatron_ds.arguments import ArgumentsError, parse_args
    base = TINY + ["--train-iters", "8"]
    with pytest.raises(ArgumentsError) as error:
        parse_args(base + ["--save-interval", "0", "--exit-interval", "-1", "--load-iteration", "x"], world_size=1)
    message = str(error.value)
    for expected in ("--save-interval must be positive, got 0", "--exit-interval must be positive, got -1",
                     "--load-iteration needs --load", "--load-iteration must be an iteration number or 'release'",
                     "--save-interval needs --save"):
        assert expected in message, message
    args = parse_args(base + ["--load", "ckpt", "--ckpt-step", "release", "--finetune"], world_size=1)
    assert (args.load_iteration, args.finetune, args.no_load_optim) == ("release", True, False)
