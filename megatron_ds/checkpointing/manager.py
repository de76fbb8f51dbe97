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
saved TP rank of them), merges each tensor and splits it for itself (resharding on load). A
Megatron-DeepSpeed checkpoint folder is read per rank the same way (megatron_deepspeed.py), its RNG states
restored where its TP x PP is this run's. With
--universal-checkpoint and ds_to_universal's pointer in --load: DeepSpeed's universal loading (universal.py).
What a load does is planned before anything loads (load_plan.py: a disagreement with the flags stops
there) and set after the optimizer states, which carry the saved LR. The RNG states
are restored right before the first iteration, so the resumed run repeats the uninterrupted one bit for
bit.
"""
import dataclasses
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron_ds.checkpointing import async_save, discovery, files, layout, load_plan, placement
from megatron_ds.checkpointing.exit_policy import ExitPolicy
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import deepspeed_universal as universal
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.checkpointing.hooks import reached_save_phase
from megatron_ds.checkpointing.load_plan import TrainingProgress
from megatron_ds.checkpointing.rank_state import stack_expert_slices
from megatron_ds.checkpointing.rng import collect_rng_state, restore_rng_state
from megatron_ds.checkpointing.state import grouped_expert_files, read_rank_state, read_resharded_rank_state
from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.pipeline_schedules import placement_note
from megatron_ds.launch.runtime import device, print_rank_0


def _coordinates():
    return {"rank": dist.get_rank(), "tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(), "dp": parallel_state.get_data_parallel_rank(),
            "sp": parallel_state.get_sequence_parallel_rank(), "cp": parallel_state.get_context_parallel_rank()}


def _expert_coordinates(expert_parallel_size):
    """An MoE run's expert-parallel rank ("ep": which experts this rank holds) and expert-data-parallel rank
    ("edp": its share of their ZeRO partitions), as DeepSpeed's groups have them. expert_parallel_size None: a
    dense model ({})."""
    if expert_parallel_size is None:
        return {}
    name = parallel_state.expert_group_name(expert_parallel_size)
    return {"ep": deepspeed_internals.expert_parallel_rank(name),
            "edp": deepspeed_internals.expert_data_parallel_rank(name)}


def _note_fresh_fp8_histories(count):
    """One line where the checkpoint lacked FP8 amax histories on any rank (count: this rank's)."""
    lacking = torch.tensor(int(count > 0), device=device())
    dist.all_reduce(lacking, op=dist.ReduceOp.MAX)
    if lacking.item():
        print_rank_0("note: FP8 delayed scaling: the checkpoint has no amax histories for this run's FP8 linears; "
                     "they start fresh (scales 1)")


def _peak_resident_gib_of_any_rank():
    """The largest peak RSS of the ranks (getrusage), in GiB: what loading cost at most, with what came before."""
    import resource

    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20], dtype=torch.float64,
                        device=device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


# --- the manager the training loop calls --------------------------------------------------------------

class CheckpointManager:
    """What the training loop calls: load() before training, restore_rng() right before the first iteration,
    after_iteration() after each one, finish() at the end. args: the resolved arguments, recorded whole in each
    checkpoint; the manager reads its parts (checkpointing, parallel, model). start_time: time.time() when the job
    started, for --exit-duration-in-mins (default: now)."""

    def __init__(self, args, engine, ds_config, start_time=None):
        self.engine, self.ds_config = engine, ds_config
        self.config, self.layout, self.model = args.checkpointing, args.parallel, args.model
        self.args_record = files.args_to_dict(args)
        self.pipelined = isinstance(engine, deepspeed.PipelineEngine)
        self.request = load_plan.LoadRequest.of_run(args, self._layout())
        self.moe = files.is_moe(self.request.shape)
        self.last_saved_iteration = None
        self.loaded_iteration = None
        self.rng_state_to_restore = None
        self.universal_info = None  # DeepSpeed's universal_checkpoint_info, computed at the first save
        # DeepSpeed writes through its checkpoint engine: ours keeps a failed write for the ranks to agree on (and
        # with --async-save writes in a thread)
        self.writer = async_save.BackgroundWriter() if self.config.async_save else async_save.FileWriter()
        deepspeed_internals.replace_checkpoint_engine(engine, self.writer)
        self.exit_policy = ExitPolicy(self.config, start_time)

    # ---- called by the training loop ----

    def after_iteration(self, progress):
        """Save at --save-interval; on a signal, past --exit-duration-in-mins or at --exit-interval save and return
        True (stop training)."""
        if self.config.save and self.config.save_interval and progress.iteration % self.config.save_interval == 0:
            self.save(progress)
        reason = self.exit_policy.reason_to_stop(progress.iteration,
                                                 "checkpoint saved" if self.config.save else "no --save, nothing saved")
        if reason is None:
            return False
        self._save_before_exit(progress)
        print_rank_0(reason)
        return True

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
        engine = self.engine
        if not self.config.save or self.last_saved_iteration == progress.iteration:
            return
        self.wait_for_saves()
        start = time.perf_counter()
        tag = files.tag_for(progress.iteration)
        tmp_path = os.path.join(self.config.save, tag + files.TMP_SUFFIX)
        self._on_every_rank(progress.iteration, lambda: self._prepare_folder(tmp_path))
        # the metadata's values as they are now (training goes on while an asynchronous save is written)
        metadata = files.new_metadata(
            files.FORMAT_DEEPSPEED, tag, self.args_record, self._layout(), iteration=progress.iteration,
            consumed_train_samples=progress.consumed_train_samples,
            consumed_valid_samples=progress.consumed_valid_samples,
            consumed_train_tokens=progress.consumed_train_tokens,
            scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            ranks=self._rank_entries(), has_optimizer_states=True, has_rng_states=True,
            model=self.request.shape, model_config=files.config_record(self.model))
        engine.save_checkpoint(self.config.save, tag=tag + files.TMP_SUFFIX,
                               client_state=self._client_state(progress, metadata),
                               save_latest=False)
        self._save_grouped_experts(tmp_path)
        rng_state = {**collect_rng_state(), **_coordinates()}
        rng_path = os.path.join(tmp_path, files.rng_file_name(dist.get_rank()))
        self.last_saved_iteration = progress.iteration
        if not self.config.async_save:
            self._save_synchronously(tmp_path, rng_state, rng_path, metadata, start)
        else:
            self._save_in_background(tmp_path, rng_state, rng_path, metadata, start)

    def _save_grouped_experts(self, tmp_path):
        """The dropless layers' experts, one file per expert by its global index, written by the first rank of each
        expert-data-parallel group (DeepSpeed's MoE save knows only its own MoE layers; its model-states files
        hold the experts of one expert-parallel rank, which no load reads)."""
        if not self.model.is_dropless_moe or _expert_coordinates(self.layout.expert)["edp"] != 0:
            return
        by_file = grouped_expert_files(self.engine.module, self.engine.checkpoint_mp_rank)
        if self.layout.expert_tensor_parallel and parallel_state.get_tensor_model_parallel_rank() != 0:
            return  # experts split over TP: gathered whole on every TP rank, written by the first
        for name, tensors in by_file.items():
            self.writer.save(tensors, os.path.join(tmp_path, name))

    def _client_state(self, progress, metadata):
        """What DeepSpeed writes into its model-states files besides the model: our progress and metadata (a
        universal checkpoint made from these files keeps only them), and, for ds_to_universal, how each
        parameter is split (not for MoE: ds_to_universal cannot tell experts of different EP ranks apart)."""
        portable = {key: value for key, value in metadata.items() if key != "ranks"}  # each rank's names: not needed
        state = {"megatron_ds": {**dataclasses.asdict(progress), "args": metadata["args"],
                                 universal.METADATA_KEY: portable},
                 "iteration": progress.iteration}
        if not self.moe:
            if self.universal_info is None:
                self.universal_info = universal.checkpoint_info(self.engine.module, self.model,
                                                                self.request.shape["padded_vocab_size"],
                                                                self.pipelined)
            state[UNIVERSAL_CHECKPOINT_INFO] = self.universal_info
        return state

    def _prepare_folder(self, tmp_path):
        """Rank 0: the temporary folder DeepSpeed writes into, after removing what killed saves left."""
        if dist.get_rank() == 0:
            files.remove_stale_temporaries(self.config.save)
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
        save = self.config.save
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
            timeout = self.config.distributed_timeout_minutes * 60

            def publish():
                checksums = async_save.wait_for_every_rank(tmp_path, dist.get_world_size(), timeout)
                if checksums is None:
                    return  # a rank could not write its files: its wait() reports why
                reached_save_phase("deepspeed-files", str(metadata["iteration"]))
                self._publish(tmp_path, metadata, start, checksums, background=True)
            writer.run_later(publish)
        print_rank_0(f"checkpoint of iteration {metadata['iteration']} copied in {time.perf_counter() - start:.2f} s; "
                      f"writing it in the background (--async-save)")

    def _publish(self, tmp_path, metadata, start, checksums, background=False):
        """Rank 0, once every rank's files are on disk: DeepSpeed's config, the metadata last (with the checksums the
        ranks computed while writing), then the rename and the pointers (files.publish)."""
        files.write_json(os.path.join(tmp_path, files.DS_CONFIG_FILE), self.ds_config)
        files.finish_folder(tmp_path, metadata, checksums)
        tag = metadata["tag"]
        files.publish(self.config.save, os.path.basename(tmp_path), tag, str(metadata["iteration"]))
        print(f"megatron_ds: saved checkpoint {os.path.join(self.config.save, tag)} at iteration "
              f"{metadata['iteration']} "
              f"({time.perf_counter() - start:.2f} s{', in the background' if background else ''})", flush=True)

    def wait_for_saves(self):
        """Every rank: until this rank's part of an asynchronous save is on disk (on rank 0: published); a write of
        it that failed on any rank abandons it on every rank (CheckpointSaveError)."""
        if self.config.async_save:
            self._on_every_rank(self.last_saved_iteration, self.writer.wait)

    def _layout(self):
        """This run's layout as a checkpoint records it."""
        layout = self.layout
        return {"tensor_model_parallel_size": layout.tensor, "pipeline_model_parallel_size": layout.pipeline,
                "data_parallel_size": layout.data_parallel, "world_size": layout.world_size,
                "sequence_parallel_size": layout.ulysses, "context_parallel_size": layout.context,
                "zero_stage": layout.zero_stage, "precision": str(self.model.params_dtype).replace("torch.", ""),
                "engine": "pipeline" if self.pipelined else "plain", "stage_placement": layout.stage_placement,
                "stage_layers": list(layout.stage_layers(self.model.num_layers)),
                "expert_parallel_size": layout.expert if self.model.is_moe or self.model.is_dropless_moe else 1,
                "optimizer": type(self.engine.optimizer).__name__}

    def _rank_entries(self):
        """Every rank's coordinates and DeepSpeed checkpoint rank; the first replica (data- and sequence-parallel
        rank 0) of each model shard adds its optimizer's parameter names per group (the order DeepSpeed flattens
        them in)."""
        groups = None
        if parallel_state.get_sequence_data_parallel_rank() == 0:
            names = {id(param): name for name, param in self.engine.module.named_parameters()}
            groups = [[names[id(param)] for param in group["params"]] for group in self._client_param_groups()]
        entry = {**_coordinates(), **_expert_coordinates(self.layout.expert if self.moe else None),
                 "mp_rank": self.engine.checkpoint_mp_rank, "param_groups": groups}
        entries = [None] * dist.get_world_size()
        dist.all_gather_object(entries, entry)
        return entries

    def _client_param_groups(self):
        """The parameter groups of our optimizer in their original order (DeepSpeed flattens them in this order):
        the 16-bit model parameters of ZeRO's, BF16_Optimizer's or, at ZeRO stage 0, FP16_Optimizer's groups."""
        optimizer = self.engine.optimizer
        groups = deepspeed_internals.bit16_parameter_groups(optimizer)
        return optimizer.param_groups if groups is None else [{"params": group} for group in groups]

    @staticmethod
    def _fsync_share(path):
        """Every rank fsyncs its share of the folder's files (on a shared file system any client may)."""
        for name in files.share_of(files.folder_files(path), dist.get_rank(), dist.get_world_size()):
            files.fsync_path(os.path.join(path, name))

    # ---- load ----

    def load(self):
        """Load the checkpoint --load names (if any) into the engine; the progress to resume from."""
        if not self.config.load:
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
        if tag is None and self.config.load_from_save:
            notes = []  # --save holds nothing yet: a first launch, not a missing --load
        elif tag is None and self.config.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {self.config.load}: no checkpoint there (--exit-on-missing-checkpoint)")
        for note in notes:
            print_rank_0(f"note: {note}")
        if tag is None:
            print_rank_0(f"no checkpoint loaded: peak resident memory of a rank so far {peak_before:.2f} GiB")
            return TrainingProgress()
        plan = load_plan.plan_load(self.request, self.config.load, tag, metadata)
        for change in (load_plan.rope_scaling_change(self.request, metadata),
                       load_plan.fp8_scaling_change(self.request, metadata)):
            if change:
                print_rank_0(f"note: {change}")
        verified = self._verify_checksums(tag, metadata)
        start = time.perf_counter()
        how = plan.describe_method(self.layout)
        load_optimizer = self._execute(plan, metadata)
        progress, path, finetune = plan.progress, plan.path, plan.finetune
        self.engine.lr_scheduler.resume(plan.schedule, plan.position)  # after the optimizer states: they hold the LR
        self.engine.global_steps = progress.iteration
        self.engine.global_samples = progress.consumed_train_samples
        self.loaded_iteration = progress.iteration
        rng = self._stage_rng_state(path, metadata, plan.resharded) if plan.load_rng else "not restored"
        saved_placement = placement_note(layout.recorded_stage_placement(metadata))
        dist.barrier()
        print_rank_0(f"loaded checkpoint {path} ({checkpoint_description(metadata)}{saved_placement}) via {how} in "
                      f"{time.perf_counter() - start:.2f} s: resuming at iteration {progress.iteration}, consumed "
                      f"samples {progress.consumed_train_samples}, optimizer states "
                      f"{'loaded' if load_optimizer else 'not loaded'}, RNG states {rng}, LR schedule "
                      f"{plan.schedule_source}{' (--finetune: iteration 0)' if finetune else ''}"
                      f"{' (--reset-iteration: iteration 0)' if self.config.reset_iteration and not finetune else ''}; "
                      f"{verified}; peak resident memory of a rank so far {_peak_resident_gib_of_any_rank():.2f} GiB "
                      f"({peak_before:.2f} GiB before the load)")
        return progress

    def _execute(self, plan, metadata):
        """Read the plan's states into the engine; whether optimizer states were loaded."""
        if plan.method == load_plan.UNIVERSAL:
            self._load_universal(plan.path, plan.tag, plan.load_optimizer)
            return plan.load_optimizer
        if plan.method == load_plan.DEEPSPEED:
            self.engine.load_checkpoint(self.config.load, tag=plan.tag, load_optimizer_states=plan.load_optimizer,
                                        load_lr_scheduler_states=False, load_module_only=not plan.load_optimizer)
            return plan.load_optimizer
        state = self._read_this_rank(plan.path, metadata, plan.load_optimizer, plan.resharded)
        load_optimizer = plan.load_optimizer and state.optimizer is not None
        fresh = placement.place_rank_state(self.engine, state, self.model.num_layers, self.pipelined, load_optimizer)
        _note_fresh_fp8_histories(fresh)
        if load_optimizer and self.model.params_dtype == torch.float16:
            placement.restore_loss_scale(self.engine.optimizer, plan.path, metadata)
        return load_optimizer

    def _resolve_checkpoint(self):
        """(tag, metadata, notes) of the checkpoint to load (rank 0; CheckpointError when it cannot be)."""
        if self.config.load_universal_checkpoint:
            return (*universal.resolve(self.config.load), [])
        tag, metadata, notes = discovery.resolve_checkpoint(self.config.load, self.config.load_iteration)
        skipped = universal.pointer_tag(self.config.load) if self.config.universal_checkpoint else None
        if skipped and tag:
            notes.append(f"--universal-checkpoint: {universal.POINTER} names {skipped}, older than {tag} (saved since "
                         f"the conversion): loading {tag}")
        return tag, metadata, notes

    def _verify_checksums(self, tag, metadata):
        """Every rank reads its share of the checkpoint's files and compares each one's checksum with the one written;
        a mismatch on any rank raises the same CheckpointError on every rank, naming the files and the last good
        checkpoint. Returns what the load line says about it."""
        if metadata["format"] in (universal.FORMAT, files.FORMAT_MEGATRON_DEEPSPEED_UNIVERSAL):
            return "no checksums in DeepSpeed's universal format: files not verified"
        checksums = metadata.get("checksums")
        if metadata["format"] == files.FORMAT_MEGATRON_DEEPSPEED:
            return "no checksums in Megatron-DeepSpeed's format: files not verified"
        if not checksums:
            return "no checksums in the checkpoint (saved before they were recorded): files not verified"
        start = time.perf_counter()
        path = os.path.join(self.config.load, tag)
        mine = files.share_of(checksums, dist.get_rank(), dist.get_world_size())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, files.checksum_problems(path, {name: checksums[name] for name in mine}))
        problems = sorted(problem for problems in everyone for problem in problems)
        if problems:
            message = [str(files.damaged_checkpoint_error(self.config.load, tag, problems))
                       if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(message, src=0)  # the last good checkpoint as rank 0 sees the folder
            raise CheckpointError(message[0])
        size = sum(metadata["files"].get(name, 0) for name in checksums)
        return (f"checksums of {len(checksums)} file{'s' if len(checksums) != 1 else ''} ({size / 2 ** 20:.1f} MiB) "
                f"verified in {time.perf_counter() - start:.2f} s")

    def _load_universal(self, path, tag, load_optimizer):
        """DeepSpeed's universal loading, each parameter read from the folder the saving run named it by; every
        rank first checks the files it needs (all problems raised on every rank)."""
        optimizer, num_layers = self.engine.optimizer, self.model.num_layers
        live = layout.live_parameter_names(self.engine.module, num_layers, self.pipelined)
        folders = universal.parameter_folders(path, num_layers)
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, universal.missing_files(path, folders, [name for name, _ in live],
                                                                 with_optimizer=load_optimizer))
        problems = sorted({problem for rank in problems for problem in rank})
        if problems:
            raise CheckpointError(f"universal checkpoint {path} does not fit this model or is damaged:\n  - "
                                  + "\n  - ".join(problems))
        with universal.named_as_saved(optimizer, {param: folders[name] for name, param in live}):
            self.engine.load_checkpoint(self.config.load, tag=tag, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
        if not load_optimizer:  # DeepSpeed reads the moments whenever the folder has them
            placement.reset_adam_states(optimizer)

    def _read_this_rank(self, path, metadata, load_optimizer, resharded):
        """This rank's RankState: its own (TP, PP) shard when the layout allows, else resharded."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        live = layout.live_parameter_names(self.engine.module, self.model.num_layers, self.pipelined)
        grouped = layout.grouped_expert_slices(live)
        split = dict(split_dims=layout.split_expert_dims(live), tp_size=self.layout.tensor, tp_rank=tp_rank)
        if not resharded:
            state = read_rank_state(path, metadata, tp_rank, pp_rank, with_optimizer=load_optimizer)
            return stack_expert_slices(state, grouped, **split)
        names = [expert for name, _ in live for expert in grouped.get(name, [name])]
        buffers = [name for name, _ in layout.live_buffer_names(self.engine.module, self.model.num_layers,
                                                                 self.pipelined)]
        target = (self.layout.tensor, tp_rank, self.layout.expert_tensor_parallel)
        state = read_resharded_rank_state(path, metadata, target, list(dict.fromkeys(names)),
                                          self.request.shape["padded_vocab_size"], with_optimizer=load_optimizer,
                                          buffer_names=buffers)
        return stack_expert_slices(state, grouped, **split)

    def _stage_rng_state(self, path, metadata, resharded):
        """Read this rank's RNG states (restored by restore_rng right before training)."""
        if not metadata.get("has_rng_states"):
            return "not in the checkpoint (converted): seeded from --seed"
        foreign_format = metadata["format"] == files.FORMAT_MEGATRON_DEEPSPEED
        if foreign_format and resharded:
            return "not restored (saved at another TP x PP): seeded from --seed"
        me = _coordinates()
        saved_dp = metadata["layout"]["data_parallel_size"]
        saved_sp = metadata["layout"].get("sequence_parallel_size", 1)
        saved_cp = metadata["layout"].get("context_parallel_size", 1)
        # data-, sequence- and context-parallel ranks draw the same numbers (same seed per pipeline stage), so
        # another DP, SP or CP size maps over
        candidates = [entry for entry in metadata["ranks"] if entry["tp"] == me["tp"] and entry["pp"] == me["pp"]
                      and entry["dp"] == me["dp"] % saved_dp and entry.get("sp", 0) == me["sp"] % saved_sp
                      and entry.get("cp", 0) == me["cp"] % saved_cp]
        if not candidates:
            return "not found for this rank: seeded from --seed"
        self.rng_state_to_restore = megatron_deepspeed.rng_state(path, candidates[0]) if foreign_format else \
            files.load_file(os.path.join(path, files.rng_file_name(candidates[0]["rank"])))
        same = (candidates[0]["dp"], candidates[0].get("sp", 0), candidates[0].get("cp", 0)) == (
            me["dp"], me["sp"], me["cp"])
        return "restored" if same else "restored (mapped across data- and sequence-parallel ranks)"


def checkpoint_description(metadata):
    """What the load line calls the checkpoint: another program's by its description, ours by format and layout."""
    saved = metadata["layout"]
    return metadata.get("description") or (
        f"{metadata['format']} format, saved at TP {saved['tensor_model_parallel_size']} x PP "
        f"{saved['pipeline_model_parallel_size']} x DP {saved.get('data_parallel_size')}")


def _merged(checksums_by_rank):
    """One {name: checksum} of the ranks' (each rank names only the files it wrote)."""
    return {name: checksum for checksums in checksums_by_rank for name, checksum in checksums.items()}
