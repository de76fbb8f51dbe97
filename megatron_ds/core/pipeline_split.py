"""Which transformer layers each pipeline stage holds: the even split, or Megatron-LM's uneven one. The model
build, the checkpoint layout, the planner and the dry run all ask `PipelineSplit.stage_layers`.

  no flag                                    --num-layers / PP on every pipeline rank
  --decoder-first-pipeline-num-layers F      F on the first pipeline rank, the rest evenly over the ranks after it
  --decoder-last-pipeline-num-layers L       L on the last pipeline rank (with F: the rest over the ranks between)
  --account-for-embedding-in-pipeline-split  the embedding counts as a layer: (layers + 1) / PP per rank, the
                                             first rank holding one transformer layer less
  --account-for-loss-in-pipeline-split       the loss (final norm and output layer) likewise, on the last rank
  --pipeline-model-parallel-layout "Et|(tt|)*30,mL"
                                             each model stage's items in model order, stages split by "|": E the
                                             embedding, t a transformer layer, m a multi-token prediction module,
                                             L the loss; (...)*n and x*n repeat, commas are cosmetic (Megatron-LM's
                                             syntax). Here E opens the first stage and m and L close the last (the
                                             MTP modules sit with the head); a stage may hold no layer beside them,
                                             so any schedule takes any count (DualPipeV's 2 x PP model stages too)

With v model stages per rank (interleaved) each rank's count splits evenly into its v chunks, and the embedding
and the loss count in the first chunk of the first rank and the last chunk of the last rank (Megatron-LM's
get_num_layers_to_build and get_transformer_layer_offset). The rules are Megatron-LM's; each refusal names the
flags and the numbers.
"""
import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import List, Optional, Tuple

from megatron_ds.core.pipeline_schedules import chunks_per_rank, pipeline_rank_of

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
LAYOUT_ITEMS = {"E": "the embedding", "t": "a transformer layer", "m": "a multi-token prediction module",
                "L": "the loss"}


def expand_layout(text: str) -> Tuple[str, ...]:
    """--pipeline-model-parallel-layout's stages with its repetitions unrolled: "Et*2|(tt|)*2,mL" ->
    ("Ett", "tt", "tt", "mL")."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda match: match.group(1) * int(match.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda match: match.group(1) * int(match.group(2)), text)
    return tuple(text.split("|"))


@dataclass(frozen=True)
class PipelineSplit:
    first_stage_layers: Optional[int] = None   # --decoder-first-pipeline-num-layers
    last_stage_layers: Optional[int] = None    # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False        # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False             # --account-for-loss-in-pipeline-split
    layout: Optional[Tuple[str, ...]] = None   # --pipeline-model-parallel-layout, expanded (expand_layout)

    @property
    def is_even(self) -> bool:
        return self == PipelineSplit()

    @property
    def _given_ends(self) -> List[Tuple[str, int]]:
        return [(flag, value) for flag, value in ((FIRST_FLAG, self.first_stage_layers),
                                                  (LAST_FLAG, self.last_stage_layers)) if value is not None]

    @property
    def _accounted(self) -> int:
        return int(self.account_for_embedding) + int(self.account_for_loss)

    def describe(self) -> str:
        """The flags as a command line gives them ("" for the even split)."""
        given = [f"{flag} {value}" for flag, value in self._given_ends]
        given += [flag for flag, on in ((EMBEDDING_FLAG, self.account_for_embedding),
                                        (LOSS_FLAG, self.account_for_loss)) if on]
        if self.layout is not None:
            given.append(f"{LAYOUT_FLAG} {'|'.join(self.layout)}")
        return " ".join(given)

    # --- the rules ---------------------------------------------------------------------------------------

    def problems(self, num_layers: int, pipeline: int, schedule: str = "1f1b", virtual_stages: int = 1) -> List[str]:
        """Every rule an uneven split breaks, as messages naming the flags (the even split's rules are
        ParallelLayout's)."""
        if self.is_even:
            return []
        if self.layout is not None:
            return self._layout_problems(num_layers, pipeline * chunks_per_rank(schedule, virtual_stages))
        if schedule == "dualpipev":
            return [f"{self.describe()} with --pipeline-schedule dualpipev: not built. DualPipeV's V puts the first "
                    f"and the last model stage (the embedding's and the loss's) both on pipeline rank 0, so "
                    f"Megatron-LM's first and last pipeline stage name no one rank each; use 1f1b, zbh1 or "
                    f"interleaved, or an even split"]
        if self._given_ends and self._accounted:
            return [f"{' and '.join(flag for flag, _ in self._given_ends)} cannot be combined with "
                    f"{EMBEDDING_FLAG} / {LOSS_FLAG} (Megatron-LM refuses it): give the end stages' layers, or "
                    f"count the embedding and the loss as layers"]
        chunks = chunks_per_rank(schedule, virtual_stages)
        if self._given_ends:
            return self._given_end_problems(num_layers, pipeline, chunks)
        return self._accounted_problems(num_layers, pipeline, chunks)

    def _given_end_problems(self, num_layers, pipeline, chunks):
        errors = [f"{flag} {value} must be larger than 0" for flag, value in self._given_ends if value <= 0]
        if pipeline < 2:
            errors.append(f"{self.describe()} needs --pipeline-model-parallel-size 2 or more (it is {pipeline})")
        if errors:
            return errors
        errors = [f"{flag} {value} is not divisible by --num-virtual-stages-per-pipeline-rank {chunks} (each "
                  f"pipeline rank's layers split evenly into its virtual stages)"
                  for flag, value in self._given_ends if value % chunks]
        middle_layers, middle_ranks = self._middle(num_layers, pipeline)
        left = (f"{self.describe()} with --num-layers {num_layers} and --pipeline-model-parallel-size {pipeline}: "
                f"{middle_layers} layers left for the {middle_ranks} middle pipeline rank(s)")
        if middle_layers < 0 or bool(middle_layers) != bool(middle_ranks):
            errors.append(f"{left}: " + ("more layers than the model has" if middle_layers < 0 else
                                          "the middle ranks and the layers left must both be none or both some"))
        elif middle_ranks and middle_layers % middle_ranks:
            errors.append(f"{left}, which do not divide evenly over them")
        elif middle_ranks and (middle_layers // middle_ranks) % chunks:
            errors.append(f"{left}: {middle_layers // middle_ranks} per middle rank is not divisible by "
                          f"--num-virtual-stages-per-pipeline-rank {chunks}")
        return errors

    def _layout_problems(self, num_layers, model_stages):
        others = [flag for flag, given in ((FIRST_FLAG, self.first_stage_layers is not None),
                                           (LAST_FLAG, self.last_stage_layers is not None),
                                           (EMBEDDING_FLAG, self.account_for_embedding),
                                           (LOSS_FLAG, self.account_for_loss)) if given]
        if others:
            return [f"{LAYOUT_FLAG} with {', '.join(others)}: the layout alone says where each layer goes "
                    f"(Megatron-LM refuses it too)"]
        stages, flat = self.layout, "".join(self.layout)
        unknown = sorted(set(flat) - set(LAYOUT_ITEMS))
        if unknown:
            return [f"{LAYOUT_FLAG} {'|'.join(stages)}: {', '.join(map(repr, unknown))} is no item; the items are "
                    + ", ".join(f"{key} ({meaning})" for key, meaning in LAYOUT_ITEMS.items())]
        errors = []
        if len(stages) != model_stages:
            errors.append(f"{LAYOUT_FLAG}: {len(stages)} stages, the schedule has {model_stages} model stages "
                          f"(--pipeline-model-parallel-size x its stages per rank)")
        if flat.count("t") != num_layers:
            errors.append(f"{LAYOUT_FLAG}: {flat.count('t')} transformer layers (t), --num-layers {num_layers}")
        if not stages[0].startswith("E") or flat.count("E") != 1:
            errors.append(f"{LAYOUT_FLAG}: the embedding (E) must open the first stage, once")
        if not stages[-1].endswith("L") or flat.count("L") != 1:
            errors.append(f"{LAYOUT_FLAG}: the loss (L) must close the last stage, once")
        modules = flat.count("m")
        if modules and not stages[-1].endswith("m" * modules + "L"):
            errors.append(f"{LAYOUT_FLAG}: the multi-token prediction modules (m) must come together just before "
                          f"the loss (L), in the last stage: they take the final hidden states and share its head")
        empty = [index for index, stage in enumerate(stages[1:-1], start=1) if "t" not in stage]
        if empty:
            errors.append(f"{LAYOUT_FLAG}: stage(s) {', '.join(map(str, empty))} would hold nothing (no t)")
        return errors

    def _accounted_problems(self, num_layers, pipeline, chunks):
        counted = num_layers + self._accounted
        total = f"--num-layers {num_layers} + {self._accounted} ({self.describe()}) = {counted}"
        if counted % pipeline:
            return [f"{total} is not divisible by --pipeline-model-parallel-size {pipeline}"]
        if (counted // pipeline) % chunks:
            return [f"{total} makes {counted // pipeline} per pipeline rank (PP {pipeline}), not divisible by "
                    f"--num-virtual-stages-per-pipeline-rank {chunks}"]
        return []

    def _middle(self, num_layers, pipeline):
        """(layers, ranks) left between the given end stages."""
        ends = self._given_ends
        return num_layers - sum(value for _, value in ends), pipeline - len(ends)

    # --- the split ---------------------------------------------------------------------------------------

    def _rank_shares(self, num_layers: int, pipeline: int) -> Tuple[int, ...]:
        """Each pipeline rank's share of the layers (all its chunks), the embedding and the loss counted as layers
        where the flags say so."""
        if not self._given_ends:
            return ((num_layers + self._accounted) // pipeline,) * pipeline
        middle_layers, middle_ranks = self._middle(num_layers, pipeline)
        shares = [middle_layers // middle_ranks if middle_ranks else 0] * pipeline
        if self.first_stage_layers is not None:
            shares[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            shares[-1] = self.last_stage_layers
        return tuple(shares)

    def stage_layers(self, num_layers: int, pipeline: int, schedule: str = "1f1b",
                     virtual_stages: int = 1) -> Tuple[int, ...]:
        """The transformer layers of each model stage, in model order (stage 0 holds the embedding); a rank's
        chunks are its model stages (pipeline_schedules.model_stage). ValueError when the split breaks a rule."""
        chunks = chunks_per_rank(schedule, virtual_stages)
        broken = self.problems(num_layers, pipeline, schedule, virtual_stages)
        if self.is_even and num_layers % (pipeline * chunks):
            broken = [f"--num-layers {num_layers} does not split evenly into {pipeline * chunks} model stages"]
        if broken:
            raise ValueError("; ".join(broken))
        if self.layout is not None:
            return tuple(stage.count("t") for stage in self.layout)
        shares = self._rank_shares(num_layers, pipeline)
        counts = [shares[pipeline_rank_of(schedule, pipeline, stage, virtual_stages)] // chunks
                  for stage in range(pipeline * chunks)]
        counts[0] -= int(self.account_for_embedding)  # the embedding's place, in the first model stage
        counts[-1] -= int(self.account_for_loss)      # the loss's, in the last
        return tuple(counts)


def add_split_flags(group):
    """Megatron-LM's uneven split flags, for pretrain.py and for tools/convert_checkpoint.py's target."""
    group.add_argument(FIRST_FLAG, type=int, default=None,
                       help="transformer layers on the first pipeline stage (default: the even split); the rest "
                            "spread evenly over the stages after it")
    group.add_argument(LAST_FLAG, type=int, default=None,
                       help="transformer layers on the last pipeline stage (default: the even split); the rest "
                            "spread evenly over the stages before it")
    group.add_argument(EMBEDDING_FLAG, action="store_true",
                       help="count the embedding as one layer when splitting the layers over the pipeline stages: "
                            "the first stage holds one transformer layer less")
    group.add_argument(LOSS_FLAG, action="store_true",
                       help="count the loss (final norm and output layer) as one layer when splitting the layers "
                            "over the pipeline stages: the last stage holds one transformer layer less")
    group.add_argument(LAYOUT_FLAG, default=None,
                       help="each model stage's items in model order, stages split by |: E embedding, t transformer "
                            "layer, m multi-token prediction module, L loss; (...)*n and x*n repeat, commas are "
                            "cosmetic (e.g. DeepSeek-V3 at PP 16 under DualPipeV: \"Et|(tt|)*30,mL\")")


def split_flags(split: PipelineSplit) -> dict:
    """The flags' values (dest names) that give `split`: split_from_flags' inverse, as a checkpoint records them."""
    return {"decoder_first_pipeline_num_layers": split.first_stage_layers,
            "decoder_last_pipeline_num_layers": split.last_stage_layers,
            "account_for_embedding_in_pipeline_split": split.account_for_embedding,
            "account_for_loss_in_pipeline_split": split.account_for_loss,
            "pipeline_model_parallel_layout": None if split.layout is None else "|".join(split.layout)}


EVEN_SPLIT_FLAGS = split_flags(PipelineSplit())


def split_from_flags(values) -> PipelineSplit:
    """The split a run's flags ask for. values: a mapping of the flags' dest names, vars(args) or the arguments a
    checkpoint recorded (one saved before these flags existed: the even split)."""
    return PipelineSplit(first_stage_layers=values.get("decoder_first_pipeline_num_layers"),
                         last_stage_layers=values.get("decoder_last_pipeline_num_layers"),
                         account_for_embedding=bool(values.get("account_for_embedding_in_pipeline_split")),
                         account_for_loss=bool(values.get("account_for_loss_in_pipeline_split")),
                         layout=(expand_layout(values["pipeline_model_parallel_layout"])
                                 if values.get("pipeline_model_parallel_layout") else None))


def first_layers(stage_layers) -> List[int]:
    """The global index (0-based) of each model stage's first layer, and the layer count after the last."""
    return [0, *accumulate(stage_layers)]


def stage_of_layer(index: int, stage_layers) -> int:
    """The model stage holding global layer `index` (0-based)."""
    starts = first_layers(stage_layers)
    if not 0 <= index < starts[-1]:
        raise ValueError(f"layer {index} is not among the {starts[-1]} layers")
    return bisect_right(starts, index) - 1


def describe_stages(stage_layers) -> str:
    """'1 + 3 + 3 + 1' for a log line or a plan."""
    return " + ".join(map(str, stage_layers))
