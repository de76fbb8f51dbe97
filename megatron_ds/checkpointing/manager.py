"""Checkpoints during training: crash-safe saves through DeepSpeed's engine, exact resume, exit on a
signal or at an interval.

A save (every rank): DeepSpeed's `save_checkpoint` writes into DIR/global_stepN.tmp; each rank adds its
RNG states (Python, NumPy, torch, CUDA, the TP RNG tracker); the files are fsync'ed, and their checksums,
computed while writing them, gathered on rank 0; rank 0 writes ds_config.json and, last,
megatron_ds_checkpoint.json (iteration, consumed samples and tokens, the LR schedule's values and position,
arguments, layout, the file list with sizes and checksums), renames the folder to
DIR/global_stepN and then replaces the pointers `latest_checkpointed_iteration.txt` and `latest`. A save
killed at any point leaves the previous checkpoint published (see files.py).

A load: the checkpoint the pointers (or --load-iteration) name is checked (complete, same model shape, and
every file's checksum, each rank reading its share of the files).
Same layout, DeepSpeed format: DeepSpeed's `load_checkpoint`. Another data-, sequence- or expert-parallel
size, ZeRO stage or precision, or a checkpoint written by tools/convert_checkpoint.py: this rank's parameters
(its experts among them), fp32 master weights and Adam moments are read in canonical names and placed into
the engine directly. Another TP or PP as well: each rank reads the saved stages holding its layers (every
saved TP rank of them), merges each tensor and splits it for itself (resharding on load). With
--universal-checkpoint and ds_to_universal's pointer in --load: DeepSpeed's universal loading (universal.py).
The LR schedule is decided before anything loads (a disagreement with the flags stops there; see
_lr_schedule_to_resume) and set after the optimizer states, which carry the saved LR. The RNG states
are restored right before the first iteration, so the resumed run repeats the uninterrupted one bit for
bit.
"""
import dataclasses
import os
import signal
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron_ds.checkpointing import async_save, files, layout, universal
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.hooks import reached_save_phase
from megatron_ds.checkpointing.rng import collect_rng_state, restore_rng_state
from megatron_ds.checkpointing.state import read_loss_scaler, read_rank_state, read_resharded_rank_state
from megatron_ds.core import parallel_state
from megatron_ds.optimizer_param_scheduler import Position, lr_schedule_from_args, schedule_to_resume


@dataclasses.dataclass
class TrainingProgress:
    """Where training stands: the last finished iteration, the data positions (consumed samples) and the
    tokens trained on (samples x --seq-length of each iteration; --train-tokens counts them)."""
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0


def _print_rank_0(message):
    if dist.get_rank() == 0:
        print(f"megatron_ds: {message}", flush=True)


def _coordinates():
    return {"rank": dist.get_rank(), "tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(), "dp": parallel_state.get_data_parallel_rank(),
            "sp": parallel_state.get_sequence_parallel_rank()}


def _expert_coordinates(args):
    """An MoE run's expert-parallel rank ("ep": which experts this rank holds) and expert-data-parallel rank
    ("edp": its share of their ZeRO partitions), as DeepSpeed's groups have them; {} for a dense model."""
    if not args.moe:
        return {}
    from deepspeed.utils import groups
    name = parallel_state.expert_group_name(args.moe_expert_parallel_size)
    return {"ep": groups._get_expert_parallel_rank(name), "edp": groups._get_expert_data_parallel_rank(name)}


# --- exit on a signal -------------------------------------------------------------------------------

class ExitSignalHandler:
    """Remembers a SIGTERM (what schedulers send before killing a job); ranks agree on it once per iteration."""

    def __init__(self, signum=signal.SIGTERM):
        self.received = False
        signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank_received(self):
        return _on_any_rank(self.received)


class ExitDuration:
    """--exit-duration-in-mins: minutes since the earliest rank started (Megatron's start of training);
    ranks agree once per iteration, so all stop after the same one."""

    def __init__(self, minutes, start_time):
        from megatron_ds.glue.runtime import device
        start = torch.tensor([start_time], dtype=torch.float64, device=device())
        dist.all_reduce(start, op=dist.ReduceOp.MIN)
        self.minutes, self.start = minutes, start.item()

    def elapsed_minutes(self):
        return (time.time() - self.start) / 60

    def reached(self):
        return _on_any_rank(self.elapsed_minutes() > self.minutes)


def _peak_resident_gib_of_any_rank():
    """The largest peak RSS of the ranks (getrusage), in GiB: what loading cost at most, with what came before."""
    import resource

    from megatron_ds.glue.runtime import device
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20], dtype=torch.float64,
                        device=device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def _on_any_rank(condition):
    """True on every rank when condition holds on any (one MAX all-reduce)."""
    from megatron_ds.glue.runtime import device
    flag = torch.tensor([1 if condition else 0], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# --- the manager the training loop calls --------------------------------------------------------------

class CheckpointManager:
    """What the training loop calls: load() before training, restore_rng() right before the first iteration,
    after_iteration() after each one, finish() at the end. start_time: time.time() when the job started, for
    --exit-duration-in-mins (default: now)."""

    def __init__(self, args, engine, ds_config, start_time=None):
        self.args, self.engine, self.ds_config = args, engine, ds_config
        self.pipelined = isinstance(engine, deepspeed.PipelineEngine)
        self.last_saved_iteration = None
        self.loaded_iteration = None
        self.rng_state_to_restore = None
        self.universal_info = None  # DeepSpeed's universal_checkpoint_info, computed at the first save
        # DeepSpeed writes through its checkpoint engine: ours keeps a failed write for the ranks to agree on (and
        # with --async-save writes in a thread)
        self.writer = engine.checkpoint_engine = (async_save.BackgroundWriter() if args.async_save
                                                  else async_save.FileWriter())
        self.signal_handler = ExitSignalHandler() if args.exit_signal_handler else None
        self.exit_duration = (ExitDuration(args.exit_duration_in_mins, time.time() if start_time is None
                                           else start_time) if args.exit_duration_in_mins else None)

    # ---- called by the training loop ----

    def after_iteration(self, progress):
        """Save at --save-interval; on a signal, past --exit-duration-in-mins or at --exit-interval save and return
        True (stop training)."""
        args = self.args
        if args.save and args.save_interval and progress.iteration % args.save_interval == 0:
            self.save(progress)
        if self.signal_handler is not None and self.signal_handler.any_rank_received():
            self._save_before_exit(progress)
            _print_rank_0(f"exiting at iteration {progress.iteration}: a rank received SIGTERM "
                          f"({'checkpoint saved' if args.save else 'no --save, nothing saved'})")
            return True
        if self.exit_duration is not None and self.exit_duration.reached():
            self._save_before_exit(progress)
            _print_rank_0(f"exiting at iteration {progress.iteration}: training has run "
                          f"{self.exit_duration.elapsed_minutes():.1f} minutes (--exit-duration-in-mins "
                          f"{args.exit_duration_in_mins}; "
                          f"{'checkpoint saved' if args.save else 'no --save, nothing saved'})")
            return True
        if args.exit_interval and progress.iteration % args.exit_interval == 0:
            self._save_before_exit(progress)
            _print_rank_0(f"exiting at iteration {progress.iteration} (--exit-interval {args.exit_interval})")
            return True
        return False

    def finish(self, progress):
        """End of training: save unless that iteration is saved already or nothing was trained."""
        if progress.iteration and progress.iteration != self.loaded_iteration:
            self.save(progress)
        self.wait_for_saves()  # an asynchronous save is on disk before the process ends

    def _save_before_exit(self, progress):
        self.save(progress)
        self.wait_for_saves()

    def restore_rng(self):
        """Call right before the first iteration: everything drawn between load and here is forgotten."""
        if self.rng_state_to_restore is not None:
            restore_rng_state(self.rng_state_to_restore)
            self.rng_state_to_restore = None

    # ---- save ----

    def save(self, progress):
        """Save at this iteration (every rank). With --async-save the files are written in the background and
        this returns once they are copied; the save before it is waited for first."""
        args, engine = self.args, self.engine
        if not args.save or self.last_saved_iteration == progress.iteration:
            return
        self.wait_for_saves()
        start = time.perf_counter()
        tag = files.tag_for(progress.iteration)
        tmp_path = os.path.join(args.save, tag + files.TMP_SUFFIX)
        self._on_every_rank(progress.iteration, lambda: self._prepare_folder(tmp_path))
        args_dict = files.args_to_dict(args)
        # the metadata's values as they are now (training goes on while an asynchronous save is written)
        metadata = files.new_metadata(
            files.FORMAT_DEEPSPEED, tag, args_dict, self._layout(), iteration=progress.iteration,
            consumed_train_samples=progress.consumed_train_samples,
            consumed_valid_samples=progress.consumed_valid_samples,
            consumed_train_tokens=progress.consumed_train_tokens,
            scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            ranks=self._rank_entries(), has_optimizer_states=True, has_rng_states=True)
        engine.save_checkpoint(args.save, tag=tag + files.TMP_SUFFIX, client_state=self._client_state(progress, metadata),
                               save_latest=False)
        rng_state = {**collect_rng_state(), **_coordinates()}
        rng_path = os.path.join(tmp_path, files.rng_file_name(dist.get_rank()))
        self.last_saved_iteration = progress.iteration
        if not args.async_save:
            self._save_synchronously(tmp_path, rng_state, rng_path, metadata, start)
        else:
            self._save_in_background(tmp_path, rng_state, rng_path, metadata, start)

    def _client_state(self, progress, metadata):
        """What DeepSpeed writes into its model-states files besides the model: our progress and metadata (a
        universal checkpoint made from these files keeps only them), and, for ds_to_universal, how each
        parameter is split (not for MoE: ds_to_universal cannot tell experts of different EP ranks apart)."""
        portable = {key: value for key, value in metadata.items() if key != "ranks"}  # each rank's names: not needed
        state = {"megatron_ds": {**dataclasses.asdict(progress), "args": metadata["args"],
                                 universal.METADATA_KEY: portable},
                 "iteration": progress.iteration}
        if not self.args.moe:
            if self.universal_info is None:
                self.universal_info = universal.checkpoint_info(self.engine.module, self.args, self.pipelined)
            state[UNIVERSAL_CHECKPOINT_INFO] = self.universal_info
        return state

    def _prepare_folder(self, tmp_path):
        """Rank 0: the temporary folder DeepSpeed writes into, after removing what killed saves left."""
        if dist.get_rank() == 0:
            files.remove_stale_temporaries(self.args.save)
            os.makedirs(tmp_path, exist_ok=True)

    def _save_synchronously(self, tmp_path, rng_state, rng_path, metadata, start):
        iteration = metadata["iteration"]
        if dist.get_rank() == 0:
            reached_save_phase("deepspeed-files", str(iteration))

        def write_rank_files():
            self.writer.save(rng_state, rng_path)
            self.writer.wait()  # DeepSpeed's files and the RNG states
            return self.writer.take_checksums(tmp_path)

        checksums = _merged(self._on_every_rank(iteration, write_rank_files))
        self._on_every_rank(iteration, lambda: self._fsync_share(tmp_path))

        def publish():
            if dist.get_rank() == 0:
                self._publish(tmp_path, metadata, start, checksums)
        self._on_every_rank(iteration, publish)

    def _on_every_rank(self, iteration, step):
        """step() on this rank, then every rank learns whether a write failed on any (the all-gather is the save's
        barrier); after a failure the unfinished save is removed and every rank raises CheckpointSaveError.
        Returns what step() returned on each rank, by rank."""
        try:
            outcome = (None, step())
        except OSError as error:
            outcome = (f"rank {dist.get_rank()}: {error}", None)
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        failures = [failure for failure, _ in outcomes if failure]
        if failures:
            raise files.CheckpointSaveError(self._abandon_save(iteration, failures))
        return [result for _, result in outcomes]

    def _abandon_save(self, iteration, failures):
        """Rank 0 removes the temporary folder (the pointers are untouched); the message every rank raises."""
        save = self.args.save
        removed = f"its temporary folder {os.path.join(save, files.tag_for(iteration) + files.TMP_SUFFIX)} is removed"
        if dist.get_rank() == 0:
            try:
                files.remove_stale_temporaries(save)
            except OSError as error:
                removed = f"removing its temporary folder failed too ({error})"
        published = files.read_pointer(save) if os.path.isdir(save) else None
        kept = (f"the last saved checkpoint, {os.path.join(save, published)}, and the pointers to it are unchanged"
                if published else "no checkpoint was saved before it")
        return f"checkpoint of iteration {iteration} not saved: {'; '.join(failures)}; {removed}; {kept}"

    def _save_in_background(self, tmp_path, rng_state, rng_path, metadata, start):
        """Queue this rank's last files and its marker; rank 0 also queues the publishing, which waits for every
        rank's marker (async_save.py)."""
        writer, rank = self.writer, dist.get_rank()
        writer.save(rng_state, rng_path)
        writer.run_after_all(lambda failed: async_save.mark_finished(writer, tmp_path, rank, failed))
        if rank == 0:
            timeout = self.args.distributed_timeout_minutes * 60

            def publish():
                checksums = async_save.wait_for_every_rank(tmp_path, dist.get_world_size(), timeout)
                if checksums is None:
                    return  # a rank could not write its files: its wait() reports why
                reached_save_phase("deepspeed-files", str(metadata["iteration"]))
                self._publish(tmp_path, metadata, start, checksums, background=True)
            writer.run_later(publish)
        _print_rank_0(f"checkpoint of iteration {metadata['iteration']} copied in {time.perf_counter() - start:.2f} s; "
                      f"writing it in the background (--async-save)")

    def _publish(self, tmp_path, metadata, start, checksums, background=False):
        """Rank 0, once every rank's files are on disk: DeepSpeed's config, the metadata last (with the checksums the
        ranks computed while writing), then the rename and the pointers (files.publish)."""
        args = self.args
        files.write_json(os.path.join(tmp_path, files.DS_CONFIG_FILE), self.ds_config)
        files.finish_folder(tmp_path, metadata, checksums)
        tag = metadata["tag"]
        files.publish(args.save, os.path.basename(tmp_path), tag, str(metadata["iteration"]))
        print(f"megatron_ds: saved checkpoint {os.path.join(args.save, tag)} at iteration {metadata['iteration']} "
              f"({time.perf_counter() - start:.2f} s{', in the background' if background else ''})", flush=True)

    def wait_for_saves(self):
        """Every rank: until this rank's part of an asynchronous save is on disk (on rank 0: published); a write of
        it that failed on any rank abandons it on every rank (CheckpointSaveError)."""
        if self.args.async_save:
            self._on_every_rank(self.last_saved_iteration, self.writer.wait)

    def _layout(self):
        args = self.args
        return {"tensor_model_parallel_size": args.tensor_model_parallel_size,
                "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                "data_parallel_size": args.data_parallel_size, "world_size": args.world_size,
                "sequence_parallel_size": args.ds_sequence_parallel_size,
                "zero_stage": args.zero_stage, "precision": str(args.params_dtype).replace("torch.", ""),
                "engine": "pipeline" if self.pipelined else "plain",
                "expert_parallel_size": args.moe_expert_parallel_size if args.moe else 1,
                "optimizer": type(self.engine.optimizer).__name__}

    def _rank_entries(self):
        """Every rank's coordinates and DeepSpeed checkpoint rank; the first replica (data- and sequence-parallel
        rank 0) of each model shard adds its optimizer's parameter names per group (the order DeepSpeed flattens
        them in)."""
        groups = None
        if parallel_state.get_sequence_data_parallel_rank() == 0:
            names = {id(param): name for name, param in self.engine.module.named_parameters()}
            groups = [[names[id(param)] for param in group["params"]] for group in self._client_param_groups()]
        entry = {**_coordinates(), **_expert_coordinates(self.args), "mp_rank": self.engine.checkpoint_mp_rank,
                 "param_groups": groups}
        entries = [None] * dist.get_world_size()
        dist.all_gather_object(entries, entry)
        return entries

    def _client_param_groups(self):
        """The parameter groups of our optimizer in their original order (DeepSpeed flattens them in this order):
        the 16-bit model parameters of ZeRO's, BF16_Optimizer's or, at ZeRO stage 0, FP16_Optimizer's groups."""
        optimizer = self.engine.optimizer
        for attribute in ("bit16_groups", "bf16_groups", "fp16_groups"):
            if hasattr(optimizer, attribute):
                return [{"params": group} for group in getattr(optimizer, attribute)]
        return optimizer.param_groups

    @staticmethod
    def _fsync_share(path):
        """Every rank fsyncs its share of the folder's files (on a shared file system any client may)."""
        for name in files.share_of(files.folder_files(path), dist.get_rank(), dist.get_world_size()):
            files.fsync_path(os.path.join(path, name))

    # ---- load ----

    def load(self):
        """Load the checkpoint --load names (if any) into the engine; the progress to resume from."""
        args = self.args
        if not args.load:
            return TrainingProgress()
        peak_before = _peak_resident_gib_of_any_rank()  # before anything of the checkpoint is read
        found = [None]
        if dist.get_rank() == 0:
            try:
                found = [("ok", *self._resolve_checkpoint())]
            except CheckpointError as error:
                found = [("error", str(error))]
        dist.broadcast_object_list(found, src=0)
        if found[0][0] == "error":
            raise CheckpointError(found[0][1])
        _, tag, metadata, notes = found[0]
        for note in notes:
            _print_rank_0(f"note: {note}")
        if tag is None:
            _print_rank_0(f"no checkpoint loaded: peak resident memory of a rank so far {peak_before:.2f} GiB")
            return TrainingProgress()
        path = os.path.join(args.load, tag)
        self._check_compatible(path, metadata)
        finetune = args.finetune or tag == files.RELEASE_TAG
        load_optimizer = not (finetune or args.no_load_optim) and metadata.get("has_optimizer_states", False)
        progress = self._resumed_progress(metadata, finetune)
        schedule, position, schedule_source = self._lr_schedule_to_resume(path, metadata, progress, finetune)
        verified = self._verify_checksums(tag, metadata)
        start = time.perf_counter()
        if metadata["format"] == universal.FORMAT:
            how = "DeepSpeed's universal checkpoint loading"
            self._load_universal(path, tag, load_optimizer)
        elif self._same_deepspeed_layout(metadata):
            how = "DeepSpeed load_checkpoint"
            self.engine.load_checkpoint(args.load, tag=tag, load_optimizer_states=load_optimizer,
                                        load_lr_scheduler_states=False, load_module_only=not load_optimizer)
        else:
            what = "weights and optimizer states" if load_optimizer else "weights"
            resharded = self._needs_resharding(metadata)
            how = (f"{metadata['format']} files read per rank ({what}"
                   + (f", resharded to TP {args.tensor_model_parallel_size} x PP "
                      f"{args.pipeline_model_parallel_size})" if resharded else ")"))
            state = self._read_this_rank(path, metadata, load_optimizer, resharded)
            load_optimizer = load_optimizer and state.optimizer is not None
            self._place_rank_state(state, load_optimizer)
            if load_optimizer:
                self._restore_loss_scale(path, metadata)
        self.engine.lr_scheduler.resume(schedule, position)  # after the optimizer states: they hold the saved LR
        self.engine.global_steps = progress.iteration
        self.engine.global_samples = progress.consumed_train_samples
        self.loaded_iteration = progress.iteration
        rng = "not restored"
        if not (finetune or args.no_load_rng):
            rng = self._stage_rng_state(path, metadata)
        dist.barrier()
        _print_rank_0(f"loaded checkpoint {path} ({metadata['format']} format, saved at TP "
                      f"{metadata['layout']['tensor_model_parallel_size']} x PP "
                      f"{metadata['layout']['pipeline_model_parallel_size']} x DP "
                      f"{metadata['layout'].get('data_parallel_size')}) via {how} in "
                      f"{time.perf_counter() - start:.2f} s: resuming at iteration {progress.iteration}, consumed "
                      f"samples {progress.consumed_train_samples}, optimizer states "
                      f"{'loaded' if load_optimizer else 'not loaded'}, RNG states {rng}, LR schedule "
                      f"{schedule_source}{' (--finetune: iteration 0)' if finetune else ''}"
                      f"{' (--reset-iteration: iteration 0)' if args.reset_iteration and not finetune else ''}; "
                      f"{verified}; peak resident memory of a rank so far {_peak_resident_gib_of_any_rank():.2f} GiB "
                      f"({peak_before:.2f} GiB before the load)")
        return progress

    def _resolve_checkpoint(self):
        """(tag, metadata, notes) of the checkpoint to load (rank 0; CheckpointError when it cannot be)."""
        args = self.args
        if args.load_universal_checkpoint:
            return (*universal.resolve(args.load), [])
        tag, metadata, notes = files.resolve_checkpoint(args.load, args.load_iteration)
        skipped = universal.pointer_tag(args.load) if args.universal_checkpoint else None
        if skipped and tag:
            notes.append(f"--universal-checkpoint: {universal.POINTER} names {skipped}, older than {tag} (saved since "
                         f"the conversion): loading {tag}")
        return tag, metadata, notes

    def _verify_checksums(self, tag, metadata):
        """Every rank reads its share of the checkpoint's files and compares each one's checksum with the one written;
        a mismatch on any rank raises the same CheckpointError on every rank, naming the files and the last good
        checkpoint. Returns what the load line says about it."""
        if metadata["format"] == universal.FORMAT:
            return "no checksums in DeepSpeed's universal format: files not verified"
        checksums = metadata.get("checksums")
        if not checksums:
            return "no checksums in the checkpoint (saved before they were recorded): files not verified"
        start = time.perf_counter()
        path = os.path.join(self.args.load, tag)
        mine = files.share_of(checksums, dist.get_rank(), dist.get_world_size())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, files.checksum_problems(path, {name: checksums[name] for name in mine}))
        problems = sorted(problem for problems in everyone for problem in problems)
        if problems:
            message = [str(files.damaged_checkpoint_error(self.args.load, tag, problems))
                       if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(message, src=0)  # the last good checkpoint as rank 0 sees the folder
            raise CheckpointError(message[0])
        size = sum(metadata["files"].get(name, 0) for name in checksums)
        return (f"checksums of {len(checksums)} file{'s' if len(checksums) != 1 else ''} ({size / 2 ** 20:.1f} MiB) "
                f"verified in {time.perf_counter() - start:.2f} s")

    def _load_universal(self, path, tag, load_optimizer):
        """DeepSpeed's universal loading, each parameter read from the folder the saving run named it by; every
        rank first checks the files it needs (all problems raised on every rank)."""
        args, optimizer = self.args, self.engine.optimizer
        live = layout.live_parameter_names(self.engine.module, args.num_layers, self.pipelined)
        folders = universal.parameter_folders(path, args.num_layers)
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, universal.missing_files(path, folders, [name for name, _ in live],
                                                                 with_optimizer=load_optimizer))
        problems = sorted({problem for rank in problems for problem in rank})
        if problems:
            raise CheckpointError(f"universal checkpoint {path} does not fit this model or is damaged:\n  - "
                                  + "\n  - ".join(problems))
        with universal.named_as_saved(optimizer, {param: folders[name] for name, param in live}):
            self.engine.load_checkpoint(args.load, tag=tag, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
        if not load_optimizer:  # DeepSpeed reads the moments whenever the folder has them
            _reset_adam_states(optimizer)

    def _needs_resharding(self, metadata):
        """Saved at another TP or PP, or with the experts split over TP where this run keeps them whole (or the
        reverse): every tensor is merged over the saved TP ranks and split again (state.read_resharded_rank_state)."""
        args, saved = self.args, metadata["layout"]
        if (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"]) != \
                (args.tensor_model_parallel_size, args.pipeline_model_parallel_size):
            return True
        saved_sharded = bool(metadata["args"].get("enable_expert_tensor_parallelism"))
        return args.moe and args.tensor_model_parallel_size > 1 and \
            saved_sharded != args.enable_expert_tensor_parallelism

    def _read_this_rank(self, path, metadata, load_optimizer, resharded):
        """This rank's RankState: its own (TP, PP) shard when the layout allows, else resharded."""
        tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        if not resharded:
            return read_rank_state(path, metadata, tp_rank, pp_rank, with_optimizer=load_optimizer)
        args = self.args
        names = [name for name, _ in layout.live_parameter_names(self.engine.module, args.num_layers, self.pipelined)]
        target = (args.tensor_model_parallel_size, tp_rank, args.enable_expert_tensor_parallelism)
        return read_resharded_rank_state(path, metadata, target, list(dict.fromkeys(names)),
                                         args.padded_vocab_size, with_optimizer=load_optimizer)

    def _resumed_progress(self, metadata, finetune):
        """Where training goes on: the checkpoint's iteration and data positions, or 0 with --finetune (and a
        release checkpoint) and with --reset-iteration (Megatron-DeepSpeed's: the weights and optimizer
        states load, the iteration and the consumed train and validation samples and tokens start at 0)."""
        if finetune or self.args.reset_iteration:
            return TrainingProgress()
        samples = metadata.get("consumed_train_samples", 0)
        return TrainingProgress(metadata["iteration"], samples, metadata.get("consumed_valid_samples", 0),
                                metadata.get("consumed_train_tokens", samples * self.args.seq_length))

    def _lr_schedule_to_resume(self, path, metadata, progress, finetune):
        """(schedule, position, description) of the LR schedule after the load, decided before anything loads.
        --finetune and --no-load-lr-state: the flags' schedule from the resumed progress (iteration 0 with
        --finetune or --reset-iteration), the checkpoint's schedule unread; otherwise
        optimizer_param_scheduler.schedule_to_resume (the checkpoint's position; --override- /
        --use-checkpoint-opt_param-scheduler, or the values must agree)."""
        args = self.args
        flags_schedule = lr_schedule_from_args(args)
        resumed = Position(progress.iteration, progress.consumed_train_samples, progress.consumed_train_tokens)
        if finetune or args.no_load_lr_state:
            reason = "--no-load-lr-state" if args.no_load_lr_state else "--finetune"
            return flags_schedule, resumed, f"the flags' from iteration {progress.iteration} ({reason})"
        try:
            return schedule_to_resume(flags_schedule, metadata.get("scheduler"), resumed,
                                      args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler)
        except ValueError as error:
            raise CheckpointError(f"checkpoint {path}: {error}") from None

    def _check_compatible(self, path, metadata):
        """The same model (any layout: another TP pads the vocabulary differently, which resharding absorbs, but
        the tokenizer's vocabulary must be the same)."""
        args = self.args
        universal_format = metadata["format"] == universal.FORMAT
        resharded = universal_format or self._needs_resharding(metadata)
        differences = [d for d in files.model_shape_differences(metadata["args"], args)
                       if not resharded or "vocabulary" not in d]
        saved_vocab = metadata["args"].get("vocab_size")
        if resharded and saved_vocab not in (None, args.vocab_size):
            differences.append(f"vocabulary: checkpoint {saved_vocab} tokens, flags {args.vocab_size}")
        saved_rows = metadata["args"].get("padded_vocab_size")
        if universal_format and saved_rows > args.padded_vocab_size:  # DeepSpeed pads rows, it cannot drop them
            differences.append(f"padded vocabulary: checkpoint {saved_rows} rows, this run {args.padded_vocab_size} "
                               f"(raise --make-vocab-size-divisible-by)")
        if differences:
            raise CheckpointError(f"checkpoint {path} holds a different model than the flags describe:\n  - "
                                  + "\n  - ".join(differences))

    def _same_deepspeed_layout(self, metadata):
        saved, ours = {"expert_parallel_size": 1, "sequence_parallel_size": 1, **metadata["layout"]}, self._layout()
        keys = ("data_parallel_size", "zero_stage", "precision", "engine", "optimizer", "expert_parallel_size",
                "sequence_parallel_size")
        return (metadata["format"] == files.FORMAT_DEEPSPEED and not self._needs_resharding(metadata)
                and all(saved.get(k) == ours[k] for k in keys))

    def _place_rank_state(self, state, load_optimizer):
        """Copy this rank's weights (and fp32 master weights and Adam moments) into the engine."""
        num_layers = self.args.num_layers
        names = {}
        problems = []
        with torch.no_grad():
            for name, param in layout.live_parameter_names(self.engine.module, num_layers, self.pipelined):
                names[id(param)] = name
                tensor = state.weights.get(name)
                if tensor is None:
                    problems.append(f"{name} is missing")
                elif tuple(tensor.shape) != tuple(param.shape):
                    problems.append(f"{name} has shape {tuple(tensor.shape)}, the model {tuple(param.shape)}")
                else:
                    param.copy_(tensor.to(param.dtype))
        if problems:
            raise CheckpointError("the checkpoint does not fit this rank's model:\n  - " + "\n  - ".join(problems))
        optimizer = self.engine.optimizer
        if load_optimizer:
            _place_optimizer_state(optimizer, names, state)
        elif hasattr(optimizer, "refresh_fp32_params"):
            optimizer.refresh_fp32_params()  # fp32 master weights from the loaded weights

    def _restore_loss_scale(self, path, metadata):
        """fp16 to fp16: the dynamic loss scale goes on where it was (DeepSpeed's own load does the same), instead of
        restarting at --initial-loss-scale and skipping steps to come down again."""
        optimizer = self.engine.optimizer
        if self.args.fp16 and hasattr(optimizer, "loss_scaler"):
            for attribute, value in read_loss_scaler(path, metadata).items():
                setattr(optimizer, attribute, value)

    def _stage_rng_state(self, path, metadata):
        """Read this rank's RNG states (restored by restore_rng right before training)."""
        if not metadata.get("has_rng_states"):
            return "not in the checkpoint (converted): seeded from --seed"
        me = _coordinates()
        saved_dp = metadata["layout"]["data_parallel_size"]
        saved_sp = metadata["layout"].get("sequence_parallel_size", 1)
        # data- and sequence-parallel ranks draw the same numbers (same seed per pipeline stage), so another DP or
        # SP size maps over
        candidates = [entry for entry in metadata["ranks"] if entry["tp"] == me["tp"] and entry["pp"] == me["pp"]
                      and entry["dp"] == me["dp"] % saved_dp and entry.get("sp", 0) == me["sp"] % saved_sp]
        if not candidates:
            return "not found for this rank: seeded from --seed"
        self.rng_state_to_restore = files.load_file(os.path.join(path, files.rng_file_name(candidates[0]["rank"])))
        same = (candidates[0]["dp"], candidates[0].get("sp", 0)) == (me["dp"], me["sp"])
        return "restored" if same else "restored (mapped across data- and sequence-parallel ranks)"


def _merged(checksums_by_rank):
    """One {name: checksum} of the ranks' (each rank names only the files it wrote)."""
    return {name: checksum for checksums in checksums_by_rank for name, checksum in checksums.items()}


def _zero_groups(optimizer):
    """[(16-bit parameters, fp32 flat partition)] of DeepSpeed's ZeRO-1/2 or BF16 optimizer, else None."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return list(zip(optimizer.bit16_groups, optimizer.single_partition_of_fp32_groups))
    if isinstance(optimizer, BF16_Optimizer):
        return list(zip(optimizer.bf16_groups, optimizer.fp32_groups_flat_partition))
    return None


def _reset_adam_states(optimizer):
    """Fresh Adam moments and step (as --no-load-optim means) in DeepSpeed's ZeRO-1/2 or BF16 optimizer."""
    for _, flat in _zero_groups(optimizer):
        optimizer.optimizer.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                           "exp_avg_sq": torch.zeros_like(flat)}
    optimizer._hp_optimizer_states_linked = False  # link the new moments at the next step


def _place_optimizer_state(optimizer, names, state):
    """Put fp32 master weights and Adam moments (full per-parameter tensors of this TP/PP rank) into
    DeepSpeed's ZeRO-1/2 or BF16 optimizer (this DP rank's flat partitions), or a plain torch optimizer."""
    step = torch.tensor(float(state.optimizer_step or 0))
    zero_groups = _zero_groups(optimizer)
    if zero_groups is not None:
        for params, flat in zero_groups:
            moments = {"exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
            targets = {"fp32": flat.data, **moments}
            for param in params:
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is None:  # no part of this parameter lives in this data-parallel rank's partition
                    continue
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                values = state.optimizer[names[id(param)]]
                for key, target in targets.items():
                    source = values[key].reshape(-1).narrow(0, lp.start, lp.numel)
                    target.narrow(0, hp.start, hp.numel).copy_(source)
            optimizer.optimizer.state[flat] = {"step": step.clone(), **moments}
        optimizer._hp_optimizer_states_linked = False  # link the new moments at the next step
        return
    if type(optimizer).__module__.startswith("torch.optim"):
        for group in optimizer.param_groups:
            for param in group["params"]:
                values = state.optimizer[names[id(param)]]
                optimizer.state[param] = {"step": step.clone(),
                                          "exp_avg": values["exp_avg"].to(param.device, param.dtype).clone(),
                                          "exp_avg_sq": values["exp_avg_sq"].to(param.device, param.dtype).clone()}
        return
    raise CheckpointError(f"cannot place optimizer states into DeepSpeed's {type(optimizer).__name__}; "
                          f"load with --no-load-optim (weights only, fresh Adam moments)")
