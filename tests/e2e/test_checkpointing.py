"""Checkpoints in training, through the real launcher: a resumed run repeats the uninterrupted one bit for
bit (fp32, dropout on), a save killed with SIGKILL mid-way leaves the previous checkpoint published and
loadable, SIGTERM saves and exits, a file whose bytes changed after the save is refused by its checksum; the
checkpoint flags are validated. The format's and the manager's own tests (damaged checkpoints, other phases,
--load messages, checksums) are in tests/unit/checkpointing/."""
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

from megatron_ds.checkpointing import files, layout, state
from megatron_ds.conversion.convert import to_megatron_deepspeed
from tests.support.checkpoints import (
    TINY,
    assert_previous_checkpoint_published,
    corrupt_bytes,
    full_state,
    layout_flags,
)
from tests.support.fault_injection import pause_message
from tests.support.launch import BIN, LOSS_LINE, REPO, assert_succeeded, launch

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2", "--ffn-hidden-size", "64"]
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _printed(output):
    """{iteration: the lm loss exactly as printed} and the same for validation losses."""
    return dict(LOSS_LINE.findall(output)), dict(VALIDATION_LINE.findall(output))


def _run(nproc, flags):
    result = launch(nproc, flags, timeout=300)
    assert_succeeded(result, tail=5000)
    return result.stdout


FP8 = ("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "3",
       "--fp8-amax-compute-algo", "max", "--sequence-parallel")
FP8_DROPLESS = ("--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "3", "--swiglu", "--num-experts", "4",
                "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                "--moe-grouped-gemm")


@pytest.mark.parametrize("family,tp,pp,dp,extra", [("gpt2", 2, 2, 1, ()),
                                                  ("llama", 1, 1, 2, ("--async-save", "--attention-backend", "flash")),
                                                  ("gpt2", 2, 1, 1, FP8), ("gpt2", 1, 1, 2, FP8_DROPLESS)],
                         ids=["gpt2-tp2-pp2-dp1", "llama-tp1-pp1-dp2-async-save", "gpt2-tp2-sp-fp8-delayed",
                              "gpt2-ep2-dropless-fp8-delayed"])
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path, family, tp, pp, dp, extra):
    """8 iterations straight (saving at 4 and 8) vs a new process that loads iteration 4 and trains 5-8:
    every printed lm loss (and validation loss) is identical, and so is every saved tensor at iteration 8
    (weights, fp32 master weights, Adam moments). The LLaMA runs write their checkpoints in the background
    (--async-save) while training goes on, and draw their attention dropout as flash_attention's hashed mask. Under
    FP8 with delayed scaling (bf16 master weights in DeepSpeed's BF16_Optimizer) the scales come from earlier steps'
    amaxes: the checkpoint holds each linear's amax history and scales, and the resume restores them exactly."""
    flags = TINY + (LLAMA if family == "llama" else []) + layout_flags(tp, pp) + [
        "--train-iters", "8", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--eval-interval", "4", "--eval-iters", "1", *extra]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = _run(tp * pp * dp, flags + ["--save", str(straight), "--save-interval", "4"])
    second = _run(tp * pp * dp, flags + ["--load", str(straight), "--load-iteration", "4", "--save", str(resumed)])

    assert "RNG states restored" in second and "resuming at iteration 4, consumed samples 16" in second, second
    loaded = files.read_metadata(straight / "global_step4")
    assert f"checksums of {len(loaded['files'])} files (" in second, second
    (losses, validation), (resumed_losses, resumed_validation) = _printed(first), _printed(second)
    assert sorted(map(int, losses)) == list(range(1, 9)) and sorted(map(int, resumed_losses)) == [5, 6, 7, 8]
    assert {i: losses[i] for i in resumed_losses} == resumed_losses, (losses, resumed_losses)
    assert resumed_validation == {"8": validation["8"]}, (validation, resumed_validation)
    assert len(set(losses.values())) > 1  # dropout and learning make every iteration different

    expected, observed = full_state(straight / "global_step8"), full_state(resumed / "global_step8")
    assert expected.optimizer_step == observed.optimizer_step == 8
    histories = [name for name in expected.weights if name.endswith("fp8_recipe.amax_history")]
    if "--fp8-format" in extra:  # delayed scaling (the default), three steps of amaxes each: of each layer's QKV,
        # projection, fc1 and fc2, or QKV, projection and its experts (a row per expert and GEMM)
        assert len(histories) == (3 if "--num-experts" in extra else 4) * 2, histories
        assert bool((expected.weights[histories[0]] > 0).all()), expected.weights[histories[0]]
    else:
        assert not histories, histories
    for name, tensor in expected.weights.items():
        assert torch.equal(tensor, observed.weights[name]), name
        for key in () if layout.is_fp8_scaling_state(name) else state.OPTIMIZER_KEYS:  # buffers: no moments
            assert torch.equal(expected.optimizer[name][key], observed.optimizer[name][key]), (name, key)
    metadata = files.read_metadata(resumed / "global_step8")
    assert (metadata["iteration"], metadata["consumed_train_samples"], metadata["consumed_valid_samples"]) == \
        (8, 32, 8)
    for folder in (straight / "global_step8", resumed / "global_step8"):
        _assert_every_file_has_its_checksum(folder)
    assert (resumed / files.MEGATRON_TRACKER).read_text().strip() == "8"
    assert (resumed / files.DEEPSPEED_POINTER).read_text().strip() == "global_step8"
    assert (resumed / "global_step8" / files.DS_CONFIG_FILE).is_file()


DELAYED = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "3",
           "--fp8-amax-compute-algo", "max"]


def _histories(folder):
    """{canonical name: amax history} of FP8 delayed scaling in a checkpoint folder."""
    return {name: tensor for name, tensor in full_state(folder).weights.items()
            if name.endswith("fp8_recipe.amax_history")}


def test_fp8_delayed_scaling_state_loads_across_layouts_history_lengths_and_recipes(tmp_path):
    """Saved at TP 2 + SP after 4 iterations (history 3), each load trains iteration 5 and saves it: after one more
    step each history holds the saved one moved down a row (so it was loaded, whole), at TP 1 (resharded) and at a
    longer history (its newest rows, then zeros); a run with another recipe loads the weights without the state; and
    a bf16 checkpoint, or the checkpoint written in Megatron-DeepSpeed's format, starts delayed scaling fresh. Each load
    that does not restore the state as it was saved says so in one note line."""
    flags = TINY + ["--train-iters", "5", "--eval-interval", "0"]
    delayed = tmp_path / "delayed"
    _run(2, flags + layout_flags(2, 1) + DELAYED + ["--sequence-parallel", "--save", str(delayed),
                                                      "--save-interval", "4", "--exit-interval", "4"])
    saved = _histories(delayed / "global_step4")
    assert len(saved) == 8 and all(bool((history > 0).all()) for history in saved.values()), saved

    def load(into, nproc, extra, source=delayed):
        """The histories saved after iteration 5 of a run loading `source`, and the run's load note on them."""
        output = _run(nproc, flags + layout_flags(nproc, 1) + extra + ["--load", str(source), "--save",
                                                                       str(tmp_path / into)])
        notes = [line.removeprefix("megatron_ds: ") for line in output.splitlines()
                 if line.startswith("megatron_ds: note: ") and "FP8" in line]
        return _histories(tmp_path / into / "global_step5"), notes

    loaded, notes = load("tp1", 1, DELAYED)
    assert not notes, notes
    for name, history in loaded.items():
        assert torch.equal(history[1:], saved[name][:2]), name
    longer = DELAYED[:-3] + ["5", "--fp8-amax-compute-algo", "max", "--sequence-parallel"]
    loaded, notes = load("longer", 2, longer)
    assert notes == ["note: FP8 delayed scaling: the checkpoint's amax histories of 3 steps are read into "
                     "--fp8-amax-history-len 5: their newest 3 steps kept"], notes
    for name, history in loaded.items():
        assert torch.equal(history[1:4], saved[name]) and not history[4].any(), (name, history, saved[name])
    loaded, notes = load("tensorwise", 2, ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    assert loaded == {} and notes == ["note: the checkpoint's FP8 delayed scaling state (amax histories and scales) "
                                      "is not used by this run"], notes
    fresh_note = ["note: FP8 delayed scaling: the checkpoint has no amax histories for this run's FP8 linears; they "
                  "start fresh (scales 1)"]

    to_megatron_deepspeed(str(delayed), str(tmp_path / "mds"))  # its format has no place for the state
    converted, notes = load("from-mds", 2, DELAYED + ["--sequence-parallel"], source=tmp_path / "mds")
    assert len(converted) == 8 and all(not history[1:].any() for history in converted.values()), converted
    assert notes == fresh_note, notes

    bf16 = tmp_path / "bf16"
    _run(1, flags + layout_flags(1, 1) + ["--bf16", "--save", str(bf16), "--save-interval", "4",
                                          "--exit-interval", "4"])
    fresh, notes = load("fresh", 1, DELAYED, source=bf16)
    assert len(fresh) == 8 and all(not history[1:].any() and history[0].all() for history in fresh.values()), fresh
    assert notes == fresh_note, notes


def _assert_every_file_has_its_checksum(folder):
    """Each file of the checkpoint has the checksum its writer computed (the metadata file excluded)."""
    metadata = files.read_metadata(folder)
    assert set(metadata["checksums"]) == set(metadata["files"]), metadata["checksums"]
    assert files.checksum_problems(str(folder), metadata["checksums"]) == []


# --- killed saves -----------------------------------------------------------------------------------

class _Job:
    """A program under torchrun in the background (pretrain.py, or ["-m", "tests.support.fault_injection", ...]),
    its output collected line by line."""

    def __init__(self, nproc, program):
        from tests.support.distributed import free_port
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
                   *program]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
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


KILL_FLAGS = TINY + layout_flags(1, 2) + ["--train-iters", "6", "--save-interval", "2", "--eval-interval", "0",
                                           "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _kill_during_save(save_dir, phase, *extra):
    """Train with saves every 2 iterations; hold the save of iteration 4 at `phase`, then SIGKILL everything."""
    job = _Job(2, ["-m", "tests.support.fault_injection", f"{phase}@4", *KILL_FLAGS, "--save", str(save_dir), *extra])
    job.wait_for(pause_message(f"{phase}@4"))
    job.kill()


@pytest.fixture(scope="module")
def killed_in_deepspeed_files(tmp_path_factory):
    """Killed right after DeepSpeed wrote its files of iteration 4 into the temporary folder."""
    save_dir = tmp_path_factory.mktemp("killed")
    _kill_during_save(save_dir, "deepspeed-files")
    return save_dir


def test_save_killed_after_deepspeed_wrote_its_files_leaves_the_previous_checkpoint(killed_in_deepspeed_files):
    save_dir = killed_in_deepspeed_files
    notes = assert_previous_checkpoint_published(save_dir)
    assert any(name.startswith("zero_pp_rank") for name in os.listdir(save_dir / "global_step4.tmp"))
    assert not (save_dir / "global_step4").exists()
    assert any("global_step4.tmp" in note for note in notes), notes
    full_state(save_dir / "global_step2")  # every file of it reads


def test_save_killed_after_publishing_the_folder_keeps_the_pointers(tmp_path):
    """Killed after the rename, before the pointers moved: the new folder is complete but not loaded."""
    _kill_during_save(tmp_path, "pointers")
    notes = assert_previous_checkpoint_published(tmp_path)
    assert any("global_step4 is newer" in note and "it is complete" in note for note in notes), notes
    assert not files.problems_of(str(tmp_path / "global_step4"))


@pytest.mark.parametrize("phase", ["deepspeed-files", "pointers"])
def test_async_save_killed_mid_way_leaves_the_previous_checkpoint(tmp_path, phase):
    """--async-save: the save of iteration 4 is written by a thread while training goes on; killed when every
    rank's files are in the temporary folder, or after the rename before the pointers, iteration 2 stays
    the published checkpoint."""
    _kill_during_save(tmp_path, phase, "--async-save")
    notes = assert_previous_checkpoint_published(tmp_path)
    if phase == "deepspeed-files":
        assert any(name.startswith("zero_pp_rank") for name in os.listdir(tmp_path / "global_step4.tmp"))
        assert not (tmp_path / "global_step4").exists()
    else:
        assert any("global_step4 is newer" in note and "it is complete" in note for note in notes), notes


@pytest.fixture(scope="module")
def resumed_until_sigterm(killed_in_deepspeed_files, tmp_path_factory):
    """(folder, output) of pretrain.py --load resuming after the SIGKILL in the middle of a save, with
    --exit-signal-handler and saves every 2 iterations, until a SIGTERM sent to the launcher after iteration 5."""
    save_dir = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(killed_in_deepspeed_files, save_dir)
    flags = list(KILL_FLAGS)
    flags[flags.index("--train-iters") + 1] = "100000"  # run until the SIGTERM; the saved LR schedule goes on
    job = _Job(2, ["pretrain.py", *flags, "--save", str(save_dir), "--load", str(save_dir), "--exit-signal-handler",
                   "--use-checkpoint-opt_param-scheduler"])
    job.wait_for(" iteration 5/100000 |")
    job.process.send_signal(signal.SIGTERM)
    job.process.wait(timeout=120)
    job._reader.join(timeout=10)
    return save_dir, job.output


def test_killed_save_resumes_from_the_previous_checkpoint_and_sigterm_saves(resumed_until_sigterm):
    """After the SIGKILL in the middle of a save, pretrain.py --load resumes from the previous checkpoint
    (the stale temporary folder is ignored, then removed; every file's checksum verified); with
    --exit-signal-handler a SIGTERM sent to the launcher makes the ranks finish the iteration, save and exit."""
    save_dir, output = resumed_until_sigterm
    assert "loaded checkpoint" in output and "global_step2" in output and "resuming at iteration 2" in output
    assert "ignoring incomplete save(s) global_step4.tmp" in output, output[-4000:]
    verified = re.search(r"; checksums of (\d+) files \([\d.]+ MiB\) verified in [\d.]+ s;", output)
    assert verified and int(verified.group(1)) == len(files.read_metadata(save_dir / "global_step2")["files"]), \
        output[-4000:]
    exited = re.search(r"exiting at iteration (\d+): a rank received SIGTERM \(checkpoint saved\)", output)
    assert exited, output[-4000:]
    last = exited.group(1)
    assert f" iteration {last}/100000 |" in output and f" iteration {int(last) + 1}/100000 |" not in output
    assert files.read_pointer(save_dir) == f"global_step{last}"
    assert not files.problems_of(str(save_dir / f"global_step{last}"))
    _assert_every_file_has_its_checksum(save_dir / f"global_step{last}")
    assert not (save_dir / "global_step4.tmp").exists()


def test_a_model_states_file_changed_after_the_save_is_refused_and_nothing_trains(resumed_until_sigterm, tmp_path):
    """The operator's fault: 20 KB of random bytes inside a DeepSpeed model-states file of the newest checkpoint,
    its size unchanged. --load refuses it on every rank, naming the file and the last good checkpoint, before
    anything trains or is saved."""
    save_dir = tmp_path / "run"
    shutil.copytree(resumed_until_sigterm[0], save_dir)
    *_, good, newest = files.list_tags(save_dir)
    states = max((save_dir / newest).glob("*model_states.pt"), key=lambda path: path.stat().st_size)
    corrupt_bytes(states)
    written = files.read_metadata(save_dir / newest)["checksums"][states.name]
    flags = list(KILL_FLAGS)
    flags[flags.index("--train-iters") + 1] = "100000"
    result = launch(2, flags + ["--save", str(save_dir), "--load", str(save_dir),
                                "--use-checkpoint-opt_param-scheduler"], timeout=240)
    assert result.returncode != 0, result.stdout[-4000:]
    errors = {line for line in result.stdout.splitlines() if line.startswith("megatron_ds: error: ")}
    assert errors == {
        f"megatron_ds: error: checkpoint {save_dir / newest} is damaged or incomplete: {states.name} has checksum "
        f"{files.file_checksum(str(states))}, {written} was written (its bytes changed after the save). the last "
        f"good checkpoint is {save_dir / good} (iteration {files.iteration_of(good)}): load it with --load "
        f"{save_dir} --load-iteration {files.iteration_of(good)}"}, result.stdout[-4000:]
    assert not LOSS_LINE.search(result.stdout) and "saved checkpoint" not in result.stdout
    assert files.list_tags(save_dir)[-1] == newest and files.read_pointer(save_dir) == newest
