"""The parallel degrees of a run and every rule they must obey, in one place.

`ParallelLayout` holds TP, DeepSpeed-Ulysses SP, context parallelism (CP: the ring), PP, EP, the virtual stages and
the world size; the data-parallel size and the other group sizes are derived from them here and nowhere else.
`problems(model)` lists each rule the layout breaks for a model (`ModelShape`). pretrain.py's argument checks and the
planner both ask it; a `LayoutProblem` carries the planner's short reason and detail and the launcher's message naming
the flags.
Ranks are TP fastest, then Ulysses SP, then CP, then DP, then PP (core/parallel_state.py builds the groups from it):
Ulysses' all-to-alls stay inside a node, the ring goes across.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_ds.core import pipeline_schedules
from megatron_ds.core.pipeline_schedules import nearest_multiples
from megatron_ds.core.pipeline_split import PipelineSplit, first_layers


@dataclass(frozen=True)
class ModelShape:
    """What the layout rules need to know of a model. ffn_origin: a note on where the FFN width came from,
    appended to the launcher's message (e.g. "(the default for --hidden-size 48)")."""
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    seq_length: int
    num_experts: Tuple[int, ...] = (1,)
    expert_interval: int = 2
    ffn_origin: str = ""
    dropless_moe_layers: Tuple[int, ...] = ()   # the dropless MoE layers' pattern (one 0/1 per layer); () for none
    mtp_num_layers: int = 0                     # multi-token prediction modules (beside the head, last layer's kind)

    @property
    def is_moe(self) -> bool:
        return max(self.num_experts) > 1


@dataclass(frozen=True)
class LayoutProblem:
    reason: str    # the planner's name of the rule ("heads not divisible by TP")
    detail: str    # the planner's numbers ("6 heads over TP 4")
    message: str   # pretrain.py's sentence, naming the flags and the values


def stages_without_experts(num_layers, pipeline_stages, expert_interval, split=PipelineSplit()):
    """The pipeline stages (0-based) that would hold no MoE layer (every expert_interval-th layer is one)."""
    first = 1
    empty = []
    for stage, count in enumerate(split.stage_layers(num_layers, pipeline_stages)):
        if not any(layer % expert_interval == 0 for layer in range(first, first + count)):
            empty.append(stage)
        first += count
    return empty


def student_layer_carrying(teacher_layer, student_total, teacher_total):
    """--kd: the student layer (1-based) beside which teacher layer j runs: ceil(j Ls / Lt), so each pipeline stage
    runs the teacher's layers in proportion to its own."""
    return -(-teacher_layer * student_total // teacher_total)


def teacher_layers_on(student_layers, student_total, teacher_total):
    """--kd: the teacher layers (1-based, in order) that run beside the given student layers."""
    wanted = set(student_layers)
    return [j for j in range(1, teacher_total + 1) if student_layer_carrying(j, student_total, teacher_total) in wanted]


def micro_batches_per_step(global_batch_size, micro_batch_size, data_parallel_size):
    """The micro-batches each data-parallel rank runs per optimizer step: DeepSpeed's gradient accumulation steps."""
    return global_batch_size // (micro_batch_size * data_parallel_size)


@dataclass(frozen=True)
class ParallelLayout:
    """One run's parallel degrees. sequence_parallel is Megatron's (tokens outside attention split over TP);
    ulysses is DeepSpeed-Ulysses (--ds-sequence-parallel-size, or --cp-comm-type a2a's CP) and context the ring's
    CP degree (--context-parallel-size with p2p or allgather): together the ranks splitting a sample. zero_stage
    None: not known yet (pretrain.py learns it from the DeepSpeed JSON after the first checks)."""
    world_size: int
    tensor: int = 1
    pipeline: int = 1
    ulysses: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor_parallel: bool = False
    sequence_parallel: bool = False
    virtual_stages: int = 1        # model stages (chunks) per pipeline rank: interleaved's v, dualpipev's 2
    zero_stage: Optional[int] = None
    pipeline_schedule: str = "1f1b"
    split: PipelineSplit = PipelineSplit()   # which layers each stage holds (Megatron-LM's uneven split flags)

    @property
    def sequence_split(self) -> int:
        """Ranks splitting each sample's tokens: Ulysses SP x CP."""
        return self.ulysses * self.context

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica: TP x Ulysses SP x CP x PP (the sequence-split ranks of a replica read the same
        samples)."""
        return self.tensor * self.sequence_split * self.pipeline

    @property
    def divides_world(self) -> bool:
        return self.world_size % self.model_parallel_size == 0

    @property
    def data_parallel(self) -> int:
        """Model replicas: world / (TP x Ulysses SP x CP x PP)."""
        if not self.divides_world:
            raise ValueError(f"{self.describe_model_parallel()} = {self.model_parallel_size} does not divide the "
                             f"world size {self.world_size}")
        return self.world_size // self.model_parallel_size

    @property
    def sequence_data_parallel(self) -> int:
        """Ranks holding the same weights of a stage, Ulysses SP x CP x DP: DeepSpeed reduces their gradients and ZeRO
        shards their states over them."""
        return self.sequence_split * self.data_parallel

    @property
    def stage_ranks(self) -> Optional[int]:
        """Ranks of one pipeline stage (world / PP), None when PP does not divide the world."""
        return self.world_size // self.pipeline if self.world_size % self.pipeline == 0 else None

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts: a stage's ranks over EP (its data-parallel ranks over EP with expert
        tensor parallelism, the TP ranks holding different shards)."""
        sharing = self.sequence_data_parallel * (1 if self.expert_tensor_parallel else self.tensor)
        return max(sharing // self.expert, 1)

    @property
    def stage_placement(self) -> str:
        return pipeline_schedules.stage_placement(self.pipeline_schedule, self.virtual_stages)

    def stage_layers(self, num_layers: int) -> Tuple[int, ...]:
        """The transformer layers of each model stage, in model order (core/pipeline_split.py)."""
        return self.split.stage_layers(num_layers, self.pipeline, self.pipeline_schedule, self.virtual_stages)

    def layers_of_ranks(self, num_layers: int) -> List[List[int]]:
        """The global layer indices (0-based) each pipeline rank holds, all its model stages together."""
        per_rank = [[] for _ in range(self.pipeline)]
        stage_layers = self.stage_layers(num_layers)
        for stage, (start, count) in enumerate(zip(first_layers(stage_layers), stage_layers)):
            rank = pipeline_schedules.pipeline_rank_of(self.pipeline_schedule, self.pipeline, stage,
                                                       self.virtual_stages)
            per_rank[rank] += range(start, start + count)
        return per_rank

    def _head_rank(self) -> int:
        """The pipeline rank holding the last model stage (the head; DualPipeV's V ends on rank 0)."""
        model_stages = self.pipeline * pipeline_schedules.chunks_per_rank(self.pipeline_schedule, self.virtual_stages)
        return pipeline_schedules.pipeline_rank_of(self.pipeline_schedule, self.pipeline, model_stages - 1,
                                                   self.virtual_stages)

    def splits_layers(self, num_layers: int) -> bool:
        """Whether the layers split over the model stages by the rules."""
        try:
            self.stage_layers(num_layers)
        except ValueError:
            return False
        return True

    def describe_model_parallel(self) -> str:
        """"TP t x PP p", with "x Ulysses SP u" and "x CP c" after TP when above 1."""
        ulysses = f" x Ulysses SP {self.ulysses}" if self.ulysses > 1 else ""
        context = f" x CP {self.context}" if self.context > 1 else ""
        return f"TP {self.tensor}{ulysses}{context} x PP {self.pipeline}"

    def problems(self, model: ModelShape, batch: Optional[Tuple[int, int]] = None) -> List[LayoutProblem]:
        """Every rule the layout breaks for the model; with batch = (micro batch, global batch) the batch
        arithmetic too, and with a known zero_stage the ZeRO rules."""
        found = (self._division_problems(model) + self._schedule_problems() + self._sequence_problems(model)
                 + self._expert_problems(model) + self._dropless_expert_problems(model))
        if batch is not None and self.divides_world:
            found += self.batch_problems(*batch)
        return found + self.zero_problems(model)

    # --- the rules, by concern ---------------------------------------------------------------------------

    def _division_problems(self, model):
        tp, pp, sp, world, v = self.tensor, self.pipeline, self.ulysses, self.world_size, self.virtual_stages
        sizes = (f"--tensor-model-parallel-size {tp} x " + (f"--ds-sequence-parallel-size {sp} x " if sp > 1 else "")
                 + (f"--context-parallel-size {self.context} x " if self.context > 1 else ""))
        rules = [
            (world % self.model_parallel_size, "TP x Ulysses SP x CP x PP does not divide the world size",
             f"{self.describe_model_parallel()} over {world} ranks",
             f"{sizes}--pipeline-model-parallel-size {pp} = {self.model_parallel_size} does not divide the world "
             f"size {world} (the number of launched ranks)"),
            (model.num_attention_heads % tp, "heads not divisible by TP",
             f"{model.num_attention_heads} heads over TP {tp}",
             f"--num-attention-heads {model.num_attention_heads} is not divisible by --tensor-model-parallel-size "
             f"{tp}"),
            (model.num_query_groups % tp, "kv heads not divisible by TP",
             f"{model.num_query_groups} kv heads over TP {tp}",
             f"--num-key-value-heads {model.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}"),
            (model.ffn_hidden_size % tp, "FFN not divisible by TP", f"FFN {model.ffn_hidden_size} over TP {tp}",
             f"--ffn-hidden-size {model.ffn_hidden_size}{model.ffn_origin} is not divisible by "
             f"--tensor-model-parallel-size {tp}"),
            (self.split.is_even and model.num_layers % pp, "layers not divisible by PP",
             f"{model.num_layers} layers over PP {pp}",
             f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"),
            (self.split.is_even and v > 1 and model.num_layers % (pp * v),
             "layers not divisible by PP x virtual stages",
             f"{model.num_layers} layers over PP {pp} x {v} virtual stages",
             f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x {v} "
             f"{self._chunk_name()} per pipeline rank (nearest: "
             f"{' or '.join(map(str, nearest_multiples(model.num_layers, pp * v)))} layers)"),
        ]
        uneven = [LayoutProblem("uneven pipeline split", message, message) for message in
                  self.split.problems(model.num_layers, pp, self.pipeline_schedule, v)]
        return _broken(rules) + uneven

    def _chunk_name(self):
        return "stages (dualpipev's V)" if self.pipeline_schedule == "dualpipev" else "virtual stages"

    def _schedule_problems(self):
        return [LayoutProblem("pipeline schedule", message, message) for message in
                pipeline_schedules.schedule_problems(self.pipeline_schedule, self.pipeline, self.virtual_stages)]

    def _sequence_problems(self, model):
        tp, u, seq, heads, megatron_sp = (self.tensor, self.ulysses, model.seq_length, model.num_attention_heads,
                                          self.sequence_parallel)
        flag = f"--ds-sequence-parallel-size {u}"
        rules = [
            (megatron_sp and seq % tp, "sequence not divisible by TP (SP)", f"sequence {seq} over TP {tp}",
             f"--sequence-parallel: --seq-length {seq} is not divisible by --tensor-model-parallel-size {tp}"),
            (u > 1 and seq % (u * (tp if megatron_sp else 1)), "sequence not divisible by Ulysses SP",
             f"sequence {seq} over Ulysses SP {u}" + (f" x TP {tp} (SP)" if megatron_sp else ""),
             f"{flag}: --seq-length {seq} is not divisible by "
             + (f"SP {u} x --tensor-model-parallel-size {tp} (--sequence-parallel)" if megatron_sp else f"SP {u}")),
            (u > 1 and heads % tp == 0 and (heads // tp) % u, "heads of a TP rank not divisible by Ulysses SP",
             f"{heads} heads over TP {tp} = {heads // tp} per TP rank, over Ulysses SP {u}",
             f"{flag}: the {heads // tp} attention heads of a TP rank (--num-attention-heads {heads} / "
             f"--tensor-model-parallel-size {tp}) do not split over SP {u}"),
        ]
        return _broken(rules) + self._context_problems(model)

    def _context_problems(self, model):
        """CP cuts the sequence into 2 x CP chunks (each rank: a head and a tail chunk), each split over Ulysses SP
        (and TP with Megatron SP)."""
        c, seq = self.context, model.seq_length
        within = self.ulysses * (self.tensor if self.sequence_parallel else 1)
        parts = "".join([f" x SP {self.ulysses}" if self.ulysses > 1 else "",
                         f" x --tensor-model-parallel-size {self.tensor} (--sequence-parallel)"
                         if self.sequence_parallel and self.tensor > 1 else ""])
        return _broken([
            (c > 1 and seq % (2 * c * within), "sequence not divisible by 2 x CP",
             f"sequence {seq} over 2 x CP {c}" + (f" x {within}" if within > 1 else ""),
             f"--context-parallel-size {c}: --seq-length {seq} is not divisible by 2 x CP {c}{parts} (each CP rank "
             f"holds two chunks of the sequence, chunk i and 2 CP - 1 - i, for causal load balance)"),
        ])

    def _expert_problems(self, model):
        if not model.is_moe or self.expert < 1 or min(model.num_experts) < 1:
            return []
        tp, pp, ep, u, world, stage = (self.tensor, self.pipeline, self.expert, self.ulysses, self.world_size,
                                       self.stage_ranks)
        experts = f"--num-experts {' '.join(map(str, model.num_experts))}"
        data = stage // tp if stage and stage % tp == 0 else None   # a stage's ranks per TP rank (Ulysses x DP)
        rules = [
            (u > 1, "MoE with Ulysses SP", f"Ulysses SP {u}: each rank's MoE layers would route its slice of the "
                                           f"sequence alone (pretrain.py refuses it)",
             f"--ds-sequence-parallel-size {u} with --num-experts above 1: not built (the MoE layers would route "
             f"each rank's slice on its own)"),
            (self.context > 1, "DeepSpeed-MoE with CP", f"CP {self.context}: DeepSpeed-MoE's capacity is per rank's "
                                                        f"tokens (the dropless layer carries CP)",
             f"--context-parallel-size {self.context} with DeepSpeed-MoE (--num-experts with Megatron-DeepSpeed's MoE "
             f"flags): not built; the dropless layer (--moe-router-topk and Megatron-Core's flags) carries CP"),
            (not self.expert_tensor_parallel and stage and stage % ep,
             "expert parallel size does not divide TP x DP",
             f"EP {ep} over TP {tp} x DP {self._data_or_none()} (expert-parallel groups are runs of a stage's ranks)",
             f"--moe-expert-parallel-size {ep} does not divide the {stage} ranks of a pipeline stage (TP x DP = world "
             f"size {world} / PP {pp}): the experts are spread over consecutive runs of them"),
            (self.expert_tensor_parallel and data and data % ep, "expert parallel size does not divide DP",
             f"EP {ep} over DP {self._data_or_none()} (experts split over TP: expert-parallel groups are runs of DP "
             f"ranks)",
             f"--moe-expert-parallel-size {ep} does not divide the data-parallel size {data} (world size {world} / "
             f"TP {tp} / PP {pp}): with --enable-expert-tensor-parallelism the experts are spread over the "
             f"data-parallel ranks of each TP rank"),
            (self.sequence_parallel, "MoE with sequence parallelism",
             "DeepSpeed's MoE splits replicated tokens over TP",
             f"{experts} with --sequence-parallel: DeepSpeed's MoE splits replicated tokens over the TP ranks, and "
             f"with sequence parallelism each TP rank holds other tokens; drop --sequence-parallel"),
        ]
        return _broken(rules) + self._stages_without_experts(model)

    def _dropless_expert_problems(self, model):
        """The dropless MoE layer: EP spans runs of a stage's ranks (TP x Ulysses x DP), and every pipeline stage
        holds an MoE layer (DeepSpeed reduces the experts' gradient norm on the stages that have experts only)."""
        if not any(model.dropless_moe_layers) or self.expert < 1:
            return []
        ep, stage, pp, layers = self.expert, self.stage_ranks, self.pipeline, len(model.dropless_moe_layers)
        tp, u = self.tensor, self.ulysses
        stages = ([[model.dropless_moe_layers[index] for index in indices] for indices in self.layers_of_ranks(layers)]
                  if self.splits_layers(layers) else [])
        if stages and model.mtp_num_layers and model.dropless_moe_layers[-1]:
            stages[self._head_rank()].append(1)  # the MTP modules' MoE layers, beside the head
        empty = [index for index, stage_layers in enumerate(stages) if not any(stage_layers)]
        rules = [
            (stage and stage % ep, "expert parallel size does not divide a stage's ranks",
             f"EP {ep} over the {stage} ranks of a stage",
             f"--expert-model-parallel-size {ep} does not divide the {stage} ranks of a pipeline stage (world size "
             f"{self.world_size} / PP {pp}): the experts are spread over consecutive runs of them"),
            (self.expert_tensor_parallel and stage and stage % tp == 0 and (stage // tp) % ep,
             "expert parallel size does not divide DP (expert TP)",
             f"EP {ep} over the {stage // tp if stage else None} ranks of a stage of one TP rank",
             f"--expert-model-parallel-size {ep} does not divide the {stage // tp if stage else None} ranks of a "
             f"pipeline stage that share a TP rank (world size {self.world_size} / PP {pp} / TP {tp}): with "
             f"--expert-tensor-parallel-size {tp} the experts are spread over the ranks of one TP rank"),
            (tp > 1 and not self.sequence_parallel and model.seq_length % (tp * self.sequence_split),
             "sequence not divisible by TP (dropless MoE)", f"sequence {model.seq_length} over TP {tp}",
             f"--tensor-model-parallel-size {tp} with the dropless MoE layer: each TP rank routes its share of the "
             f"sequence, and --seq-length {model.seq_length} is not divisible by TP {tp}"
             + (f" x --ds-sequence-parallel-size {u}" if u > 1 else "")
             + (f" x --context-parallel-size {self.context}" if self.context > 1 else "")),
            (pp > 1 and empty, "a pipeline stage without MoE layers",
             f"PP {pp}: stage(s) {', '.join(map(str, empty))} without an MoE layer",
             f"--pipeline-model-parallel-size {pp} with --moe-layer-freq: pipeline stage(s) "
             f"{', '.join(map(str, empty))} would hold no MoE layer; every stage needs one"),
        ]
        return _broken(rules)

    def _data_or_none(self):
        return self.data_parallel if self.divides_world else None

    def _stages_without_experts(self, model):
        """Every pipeline stage must hold an MoE layer: DeepSpeed reduces the experts' gradient norm over the
        pipeline group on the stages that have experts only, so a stage without would leave the others waiting."""
        pp, interval, layers = self.pipeline, model.expert_interval, model.num_layers
        if pp == 1 or interval < 1 or not self.splits_layers(layers):
            return []
        empty = stages_without_experts(layers, pp, interval, self.split)
        if not empty:
            return []
        return [LayoutProblem(
            "a pipeline stage without MoE layers", f"PP {pp} with an MoE layer every {interval} of {layers} layers",
            f"--pipeline-model-parallel-size {pp} with --expert-interval {interval}: pipeline stage(s) "
            f"{', '.join(map(str, empty))} ({layers // pp} of --num-layers {layers} each) would hold no MoE layer; "
            f"every stage needs one (a smaller --expert-interval, or fewer stages)")]

    def batch_problems(self, micro_batch_size: int, global_batch_size: int) -> List[LayoutProblem]:
        """The global batch splits into micro-batches over the data-parallel ranks."""
        dp = self.data_parallel
        if global_batch_size % (micro_batch_size * dp) == 0:
            micro_batches = micro_batches_per_step(global_batch_size, micro_batch_size, dp)
            return [LayoutProblem("pipeline schedule", message, message) for message in
                    pipeline_schedules.micro_batch_problems(self.pipeline_schedule, self.pipeline, micro_batches)]
        return [LayoutProblem(
            "global batch not a multiple of micro batch x DP", f"{global_batch_size} over {micro_batch_size} x {dp}",
            f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size {micro_batch_size} x "
            f"data-parallel size {dp} = {micro_batch_size * dp} (data-parallel size = world size {self.world_size} / "
            f"({self.describe_model_parallel()}))")]

    def zero_problems(self, model: ModelShape) -> List[LayoutProblem]:
        """DeepSpeed's pipeline takes ZeRO stage 0 or 1; its ZeRO-3 does not shard MoE experts."""
        stage, pp = self.zero_stage, self.pipeline
        if stage is None:
            return []
        experts = " ".join(map(str, model.num_experts))
        rules = [
            (stage >= 2 and pp > 1, "ZeRO-2/3 with PP > 1",
             f"ZeRO-{stage} with PP {pp} (DeepSpeed's pipeline supports stage 0 or 1)",
             f"--zero-stage {stage} with --pipeline-model-parallel-size {pp}: DeepSpeed's pipeline engine supports "
             f"only ZeRO stage 0 or 1 (ZeRO-2/3 shard gradients, which the pipeline accumulates across "
             f"micro-batches); use --zero-stage 1, or PP 1 for ZeRO-2/3"),
            (stage == 3 and (model.is_moe or any(model.dropless_moe_layers)), "ZeRO-3 with MoE",
             "DeepSpeed's ZeRO-3 does not shard MoE experts",
             f"--zero-stage 3 with --num-experts {experts}: DeepSpeed's ZeRO-3 does not shard MoE experts; use "
             f"--zero-stage 0, 1 or 2"),
        ]
        return _broken(rules)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts_of_world(world_size: int):
    """Every (Ulysses SP, TP, PP, DP) whose product is the world size, smaller Ulysses sizes first."""
    for ulysses in divisors(world_size):
        for tensor in divisors(world_size // ulysses):
            for pipeline in divisors(world_size // (ulysses * tensor)):
                yield ulysses, tensor, pipeline, world_size // (ulysses * tensor * pipeline)


def _broken(rules):
    return [LayoutProblem(reason, detail, message) for broken, reason, detail, message in rules if broken]


def generation_layout(world_size, expert_parallel_size=1) -> ParallelLayout:
    """tools/generate.py's layout: one pipeline stage whose world / EP ranks form a TP group, EP such groups
    (the experts' data-parallel ranks, all generating the same tokens). ValueError when EP does not divide
    the world."""
    if expert_parallel_size < 1 or world_size % expert_parallel_size:
        raise ValueError(f"--moe-expert-parallel-size {expert_parallel_size} does not divide the {world_size} ranks")
    return ParallelLayout(world_size=world_size, tensor=world_size // expert_parallel_size,
                          expert=expert_parallel_size)
