"""What --load will do, decided before anything is read into the engine: a pure function of the checkpoint's
metadata and the run's resolved configuration, printable, then executed by the manager (manager.py).

A LoadPlan names the checkpoint, how it is read (DeepSpeed's universal loading, DeepSpeed's load_checkpoint
when the saved layout is this run's, or this rank's state read per rank in canonical names, resharded when
TP, PP or the experts' split differ), which states load (optimizer, RNG), the progress training resumes
from and the LR schedule it follows. Every refusal (another model, a schedule that disagrees with the flags)
is raised here, with the same text on every rank (each computes the same plan from the same metadata).
"""
import dataclasses
import os

from megatron_ds.checkpointing import files
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import deepspeed_universal as universal
from megatron_ds.checkpointing.layout import recorded_stage_placement, saved_stage_layers
from megatron_ds.core.optimizer_param_scheduler import LRSchedule, Position, schedule_to_resume
from megatron_ds.core.parallel_layout import ParallelLayout
from megatron_ds.core.pipeline_schedules import placement_note

UNIVERSAL, DEEPSPEED, PER_RANK = "universal", "deepspeed", "per-rank"


@dataclasses.dataclass
class TrainingProgress:
    """Where training stands: the last finished iteration, the data positions (consumed samples) and the
    tokens trained on (samples x --seq-length of each iteration; --train-tokens counts them)."""
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What this run brings to a load: its layout and model, its checkpointing flags and its flags' LR schedule."""
    layout: ParallelLayout
    shape: dict                  # files.model_shape of the run (its padded vocabulary included)
    vocab_size: int              # the tokenizer's, before padding
    seq_length: int
    checkpointing: object        # arguments.configs.CheckpointingConfig
    lr_schedule: LRSchedule
    checkpoint_layout: dict      # this run's layout as a checkpoint records it (the manager's, with its engine)
    fp8_scaling: object = None   # the FP8 scaling state its linears keep (files.fp8_scaling_state)

    @classmethod
    def of_run(cls, args, checkpoint_layout=None):
        """The request of resolved arguments (checkpoint_layout: None where no engine exists yet)."""
        return cls(args.parallel, files.model_shape(args), args.vocab_size, args.seq_length, args.checkpointing,
                   args.optimization.lr_schedule, checkpoint_layout or {}, files.fp8_scaling_state(args))


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    path: str
    tag: str
    format: str                # the checkpoint's (files.FORMAT_*, universal.FORMAT)
    method: str                # UNIVERSAL, DEEPSPEED or PER_RANK
    resharded: bool            # PER_RANK: each tensor merged over the saved TP ranks and split for this run
    load_optimizer: bool       # fp32 master weights and Adam moments (PER_RANK: if the files hold them)
    load_rng: bool
    finetune: bool             # --finetune, or a release checkpoint: iteration 0
    progress: TrainingProgress
    schedule: LRSchedule
    position: Position
    schedule_source: str

    def describe_method(self, layout: ParallelLayout) -> str:
        """How the states are read, as the load line says it."""
        if self.method == UNIVERSAL:
            return "DeepSpeed's universal checkpoint loading"
        if self.method == DEEPSPEED:
            return "DeepSpeed load_checkpoint"
        what = "weights and optimizer states" if self.load_optimizer else "weights"
        if not self.resharded:
            return f"{self.format} files read per rank ({what})"
        split = "" if layout.split.is_even else f", {layout.split.describe()}"
        return (f"{self.format} files read per rank ({what}, resharded to TP {layout.tensor} x PP {layout.pipeline}"
                f"{placement_note(layout.stage_placement)}{split})")


def plan_load(request: LoadRequest, load_dir, tag, metadata) -> LoadPlan:
    """The plan of loading checkpoint `tag` of `load_dir` into the run that makes `request`."""
    path = os.path.join(load_dir, tag)
    check_compatible(request, path, metadata)
    config = request.checkpointing
    finetune = config.finetune or tag == files.RELEASE_TAG
    load_optimizer = not (finetune or config.no_load_optim) and metadata.get("has_optimizer_states", False)
    progress = resumed_progress(request, metadata, finetune)
    schedule, position, schedule_source = lr_schedule_to_resume(request, path, metadata, progress, finetune)
    if metadata["format"] == universal.FORMAT:
        method = UNIVERSAL
    elif same_deepspeed_layout(request, metadata):
        method = DEEPSPEED
    else:
        method = PER_RANK
    return LoadPlan(path, tag, metadata["format"], method, method == PER_RANK and needs_resharding(request, metadata),
                    load_optimizer, not (finetune or config.no_load_rng), finetune, progress, schedule, position,
                    schedule_source)


def rope_scaling_change(request: LoadRequest, metadata):
    """The note of a --finetune load that changes the RoPE scaling (None where it keeps it)."""
    saved, flags = files.saved_model_shape(metadata)["rope_scaling"], request.shape["rope_scaling"]
    if saved == flags:
        return None
    return (f"--finetune goes on from the checkpoint's weights under the flags' RoPE scaling {flags} (the "
            f"checkpoint's: {saved})")


def fp8_scaling_change(request: LoadRequest, metadata):
    """The note of a load between runs whose FP8 delayed scaling state differs (None where it is the same, or where
    only this run keeps one: the load counts what it starts fresh)."""
    saved, run = files.fp8_scaling_state(metadata["args"]), request.fp8_scaling
    if saved == run:
        return None
    if run is None:
        return "the checkpoint's FP8 delayed scaling state (amax histories and scales) is not used by this run"
    if saved is None:
        return None  # the load counts the histories it lacks (manager._note_fresh_fp8_histories)
    if saved[0] != run[0]:
        return (f"FP8 delayed scaling: the checkpoint's amax histories of {saved[0]} steps are read into "
                f"--fp8-amax-history-len {run[0]}: their newest {min(saved[0], run[0])} steps kept")
    return ("FP8 delayed scaling: the layers kept in bf16 differ from the checkpoint's (--first-last-layers-bf16); a "
            "layer's amax history is read where both runs have one, fresh where only this run does")


def needs_resharding(request: LoadRequest, metadata):
    """Saved at another TP or PP, with another placement of the stages on the pipeline ranks (dualpipev's V,
    interleaved's virtual stages) or another split of the layers over them, or with the experts split over TP
    where this run keeps them whole (or the reverse): every tensor is merged over the saved TP ranks and split
    again (state.read_resharded_rank_state)."""
    saved, layout = metadata["layout"], request.layout
    if (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"]) != (layout.tensor, layout.pipeline):
        return True
    if recorded_stage_placement(metadata) != layout.stage_placement:
        return True
    if saved_stage_layers(metadata) != layout.stage_layers(request.shape["num_layers"]):
        return True
    saved_sharded = bool(metadata["args"].get("enable_expert_tensor_parallelism"))
    return files.is_moe(request.shape) and layout.tensor > 1 and saved_sharded != layout.expert_tensor_parallel


def same_deepspeed_layout(request: LoadRequest, metadata):
    saved = {"expert_parallel_size": 1, "sequence_parallel_size": 1, "context_parallel_size": 1,
             **metadata["layout"]}
    keys = ("data_parallel_size", "zero_stage", "precision", "engine", "optimizer", "expert_parallel_size",
            "sequence_parallel_size", "context_parallel_size")
    # DeepSpeed's load knows only its own MoE layers: the dropless layer's experts are read per rank, by expert;
    # and it wants every buffer the module has: FP8 delayed scaling's state, when the saved run kept another, is
    # placed (or started fresh) per rank
    return (metadata["format"] == files.FORMAT_DEEPSPEED and not needs_resharding(request, metadata)
            and not files.is_dropless_moe(request.shape)
            and files.fp8_scaling_state(metadata["args"]) == request.fp8_scaling
            and all(saved.get(k) == request.checkpoint_layout[k] for k in keys))


def resumed_progress(request: LoadRequest, metadata, finetune):
    """Where training goes on: the checkpoint's iteration and data positions, or 0 with --finetune (and a
    release checkpoint) and with --reset-iteration (Megatron-DeepSpeed's: the weights and optimizer
    states load, the iteration and the consumed train and validation samples and tokens start at 0)."""
    if finetune or request.checkpointing.reset_iteration:
        return TrainingProgress()
    samples = metadata.get("consumed_train_samples", 0)
    return TrainingProgress(metadata["iteration"], samples, metadata.get("consumed_valid_samples", 0),
                            metadata.get("consumed_train_tokens", samples * request.seq_length))


def lr_schedule_to_resume(request: LoadRequest, path, metadata, progress, finetune):
    """(schedule, position, description) of the LR schedule after the load. --finetune and --no-load-lr-state:
    the flags' schedule from the resumed progress (iteration 0 with --finetune or --reset-iteration), the
    checkpoint's schedule unread; otherwise optimizer_param_scheduler.schedule_to_resume (the checkpoint's
    position; --override- / --use-checkpoint-opt_param-scheduler, or the values must agree)."""
    config, flags_schedule = request.checkpointing, request.lr_schedule
    resumed = Position(progress.iteration, progress.consumed_train_samples, progress.consumed_train_tokens)
    if finetune or config.no_load_lr_state:
        reason = "--no-load-lr-state" if config.no_load_lr_state else "--finetune"
        return flags_schedule, resumed, f"the flags' from iteration {progress.iteration} ({reason})"
    try:
        return schedule_to_resume(flags_schedule, metadata.get("scheduler"), resumed,
                                  config.override_opt_param_scheduler, config.use_checkpoint_opt_param_scheduler)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None


def check_compatible(request: LoadRequest, path, metadata):
    """The same model (any layout: another TP pads the vocabulary differently, which resharding absorbs, but
    the tokenizer's vocabulary must be the same)."""
    universal_format = metadata["format"] == universal.FORMAT
    resharded = universal_format or needs_resharding(request, metadata)
    saved = files.saved_model_shape(metadata)
    if request.checkpointing.finetune:  # another RoPE scaling over the same weights: a context extension
        saved = {**saved, "rope_scaling": request.shape["rope_scaling"]}
    differences = [d for d in files.model_shape_differences(saved, request.shape, request.layout.tensor)
                   if not resharded or "vocabulary" not in d]
    if saved["rope_scaling"] != request.shape["rope_scaling"]:
        differences.append("(to train these weights on under the flags' RoPE scaling, a context extension, add "
                           "--finetune)")
    saved_vocab = metadata["args"].get("vocab_size")
    if resharded and saved_vocab not in (None, request.vocab_size):
        differences.append(f"vocabulary: checkpoint {saved_vocab} tokens, flags {request.vocab_size}")
    saved_rows, rows = metadata["args"].get("padded_vocab_size"), request.shape["padded_vocab_size"]
    if universal_format and saved_rows > rows:  # DeepSpeed pads rows, it cannot drop them
        differences.append(f"padded vocabulary: checkpoint {saved_rows} rows, this run {rows} "
                           f"(raise --make-vocab-size-divisible-by)")
    if differences:
        raise CheckpointError(f"checkpoint {path} holds a different model than the flags describe:\n  - "
                              + "\n  - ".join(differences))
