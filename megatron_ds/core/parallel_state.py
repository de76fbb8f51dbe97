"""Process groups for tensor (TP), DeepSpeed-Ulysses sequence (SP), context (CP: the ring), pipeline (PP) and data
(DP) parallelism.

One topology object is the single source of truth for rank placement: axes pipe, data, context, seq, model (TP
fastest, then SP, then CP, then DP, then PP slowest). DeepSpeed's pipeline grid is handed the same placement with
SP, CP and DP folded into its data axis (`deepspeed_topology`: DeepSpeed's data-parallel ranks are our
sequence-data-parallel ranks, over which the gradients of the replicated weights are reduced), so
Megatron's groups and DeepSpeed's grid are the same groups; `assert_matches_deepspeed_grid` checks that at
start-up. Without Ulysses and CP the sequence-data-parallel group is the data-parallel group. The
sequence-split group (SP x CP) holds the ranks that split one sample's tokens.
"""
import contextlib
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from megatron_ds.core import deepspeed_internals
from megatron_ds.core.parallel_layout import ParallelLayout

AXES = ("pipe", "data", "context", "seq", "model")


@dataclass
class _ParallelGroups:
    topology: ProcessTopology
    tensor_ranks: List[int]
    pipeline_ranks: List[int]
    data_ranks: List[int]
    sequence_ranks: List[int]
    sequence_data_ranks: List[int]
    context_ranks: List[int]
    sequence_split_ranks: List[int]
    tensor_group: object
    pipeline_group: object
    data_group: object
    sequence_group: object
    sequence_data_group: object
    context_group: object
    sequence_split_group: object


_GROUPS: Optional[_ParallelGroups] = None
_ULYSSES_CHUNK_SIZE: Optional[int] = None  # FPDT: Ulysses over chunks of this many tokens (core/sequence_split.py)


def _new_groups(rank_lists):
    """Create one process group per rank list (every rank must call this in the same order); return (ranks,
    group) of the list holding this rank."""
    me = dist.get_rank()
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if me in ranks:
            mine = (ranks, group)
    return mine


def sequence_data_parallel_lists(topology):
    """The ranks that differ only in their data, context and sequence coordinates, in rank order (DeepSpeed's
    data-parallel groups under deepspeed_topology)."""
    return _folded_topology(topology).get_axis_comm_lists("data")


def sequence_split_lists(topology):
    """The ranks that differ only in their context and sequence coordinates (those splitting one sample), in rank
    order: Ulysses fastest, so rank r of a group is CP rank r // SP, Ulysses rank r % SP."""
    lists = {}
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        lists.setdefault((coord.pipe, coord.data, coord.model), []).append(rank)
    return list(lists.values())


def build_topology(tensor_model_parallel_size, pipeline_model_parallel_size, world_size,
                   sequence_parallel_size=1, context_parallel_size=1):
    """The (pipe, data, context, seq, model) topology for a world; raises ValueError when the sizes do not divide
    it."""
    return topology_of(ParallelLayout(world_size, tensor=tensor_model_parallel_size,
                                      pipeline=pipeline_model_parallel_size, ulysses=sequence_parallel_size,
                                      context=context_parallel_size))


def topology_of(layout: ParallelLayout) -> ProcessTopology:
    """The (pipe, data, context, seq, model) topology of a layout; raises ValueError when its sizes do not divide the
    world."""
    if min(layout.tensor, layout.pipeline, layout.ulysses, layout.context) < 1 or not layout.divides_world:
        raise ValueError(
            f"tensor_model_parallel_size ({layout.tensor}) x sequence_parallel_size ({layout.ulysses}) x "
            f"context_parallel_size ({layout.context}) x pipeline_model_parallel_size ({layout.pipeline}) = "
            f"{layout.model_parallel_size} must be positive and divide the world size ({layout.world_size})")
    return ProcessTopology(axes=list(AXES), dims=[layout.pipeline, layout.data_parallel, layout.context,
                                                  layout.ulysses, layout.tensor])


def deepspeed_topology():
    """The topology DeepSpeed's PipelineModule gets: ours with CP and SP folded into the data axis (they sit between
    data and model, so every rank keeps its number)."""
    return _folded_topology(get_topology())


def _folded_topology(topology):
    return PipeModelDataParallelTopology(
        num_pp=topology.get_dim("pipe"), num_mp=topology.get_dim("model"),
        num_dp=topology.get_dim("data") * topology.get_dim("context") * topology.get_dim("seq"))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              topology: Optional[ProcessTopology] = None, sequence_parallel_size: int = 1,
                              context_parallel_size: int = 1, ulysses_chunk_size: Optional[int] = None):
    """Create the TP, SP, CP, PP, DP, sequence-data-parallel and sequence-split groups for this rank.
    torch.distributed must be initialized. ulysses_chunk_size: FPDT's chunk of the sequence, which decides which
    tokens each Ulysses rank holds."""
    global _GROUPS, _ULYSSES_CHUNK_SIZE
    if _GROUPS is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    if topology is None:
        topology = build_topology(tensor_model_parallel_size, pipeline_model_parallel_size, dist.get_world_size(),
                                  sequence_parallel_size, context_parallel_size)
    tensor_ranks, tensor_group = _new_groups(topology.get_axis_comm_lists("model"))
    data_ranks, data_group = _new_groups(topology.get_axis_comm_lists("data"))
    pipeline_ranks, pipeline_group = _new_groups(topology.get_axis_comm_lists("pipe"))
    sequence_ranks, sequence_group = _new_groups(topology.get_axis_comm_lists("seq"))
    sequence_data_ranks, sequence_data_group = _new_groups(sequence_data_parallel_lists(topology))
    context_ranks, context_group, split_ranks, split_group = _context_groups(topology, sequence_ranks, sequence_group)
    _ULYSSES_CHUNK_SIZE = ulysses_chunk_size
    _GROUPS = _ParallelGroups(topology, tensor_ranks, pipeline_ranks, data_ranks, sequence_ranks,
                              sequence_data_ranks, context_ranks, split_ranks, tensor_group, pipeline_group,
                              data_group, sequence_group, sequence_data_group, context_group, split_group)


def _context_groups(topology, sequence_ranks, sequence_group):
    """(CP ranks, CP group, sequence-split ranks, sequence-split group) of this rank. Without CP no group is made
    (a launch of thousands of ranks would make as many single-rank groups): the CP group is None and the
    sequence-split group is Ulysses'."""
    if topology.get_dim("context") == 1:
        return [dist.get_rank()], None, sequence_ranks, sequence_group
    return (*_new_groups(topology.get_axis_comm_lists("context")), *_new_groups(sequence_split_lists(topology)))


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def destroy_model_parallel():
    global _GROUPS, _ULYSSES_CHUNK_SIZE
    _GROUPS, _ULYSSES_CHUNK_SIZE = None, None


def get_ulysses_chunk_size() -> Optional[int]:
    """FPDT's chunk of the sequence (None without FPDT)."""
    return _ULYSSES_CHUNK_SIZE


def _groups() -> _ParallelGroups:
    if _SIMULATED is not None:
        raise RuntimeError("simulated_model_parallel() is active: there are no process groups (planning only)")
    if _GROUPS is None:
        raise RuntimeError("model parallel groups are not initialized: call initialize_model_parallel() first")
    return _GROUPS


def get_topology() -> ProcessTopology:
    return _groups().topology


def get_tensor_model_parallel_group():
    return _groups().tensor_group


def get_tensor_model_parallel_ranks() -> List[int]:
    return list(_groups().tensor_ranks)


def get_tensor_model_parallel_world_size() -> int:
    if _SIMULATED is not None:
        return _SIMULATED.tensor_model_parallel_size
    return len(_groups().tensor_ranks) if _GROUPS is not None else 1


def get_tensor_model_parallel_rank() -> int:
    if _SIMULATED is not None:
        return _SIMULATED.tensor_model_parallel_rank
    return _groups().tensor_ranks.index(dist.get_rank()) if _GROUPS is not None else 0


def get_pipeline_model_parallel_group():
    return _groups().pipeline_group


def get_pipeline_model_parallel_ranks() -> List[int]:
    return list(_groups().pipeline_ranks)


def get_pipeline_model_parallel_world_size() -> int:
    if _SIMULATED is not None:
        return _SIMULATED.pipeline_model_parallel_size
    return len(_groups().pipeline_ranks) if _GROUPS is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    if _SIMULATED is not None:
        return _SIMULATED.pipeline_model_parallel_rank
    return _groups().pipeline_ranks.index(dist.get_rank()) if _GROUPS is not None else 0


def get_data_parallel_group():
    return _groups().data_group


def get_data_parallel_ranks() -> List[int]:
    return list(_groups().data_ranks)


def get_data_parallel_world_size() -> int:
    return len(_groups().data_ranks) if _GROUPS is not None else 1


def get_data_parallel_rank() -> int:
    return _groups().data_ranks.index(dist.get_rank()) if _GROUPS is not None else 0


def get_sequence_parallel_group():
    return _groups().sequence_group


def get_sequence_parallel_ranks() -> List[int]:
    return list(_groups().sequence_ranks)


def get_sequence_parallel_world_size() -> int:
    """Ulysses SP: the ranks that split each sample's tokens (1 without, and when planning)."""
    return len(_groups().sequence_ranks) if _GROUPS is not None and _SIMULATED is None else 1


def get_sequence_parallel_rank() -> int:
    return _groups().sequence_ranks.index(dist.get_rank()) if _GROUPS is not None and _SIMULATED is None else 0


def get_context_parallel_group():
    """The ring's ranks (CP): those holding the other chunks of this rank's part of a sample (None without CP)."""
    return _groups().context_group


def get_context_parallel_ranks() -> List[int]:
    return list(_groups().context_ranks)


def get_context_parallel_world_size() -> int:
    return len(_groups().context_ranks) if _GROUPS is not None and _SIMULATED is None else 1


def get_context_parallel_rank() -> int:
    return _groups().context_ranks.index(dist.get_rank()) if _GROUPS is not None and _SIMULATED is None else 0


def get_sequence_split_group():
    """The ranks splitting one sample's tokens: Ulysses SP x CP."""
    return _groups().sequence_split_group


def get_sequence_split_world_size() -> int:
    return len(_groups().sequence_split_ranks) if _GROUPS is not None and _SIMULATED is None else 1


def get_sequence_data_parallel_group():
    """The ranks holding the same weights: SP x CP x DP (DeepSpeed's data-parallel group)."""
    return _groups().sequence_data_group


def get_sequence_data_parallel_ranks() -> List[int]:
    return list(_groups().sequence_data_ranks)


def get_sequence_data_parallel_world_size() -> int:
    return len(_groups().sequence_data_ranks) if _GROUPS is not None else 1


def get_sequence_data_parallel_rank() -> int:
    return _groups().sequence_data_ranks.index(dist.get_rank()) if _GROUPS is not None else 0


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def all_groups_by_axis():
    """{'tensor': [...], 'data': [...], 'pipeline': [...]} (with Ulysses also 'sequence', with CP 'context', with
    either 'sequence-data'): every group's ranks, for start-up logs."""
    topology = get_topology()
    groups = {"tensor": topology.get_axis_comm_lists("model"),
              "data": topology.get_axis_comm_lists("data"),
              "pipeline": topology.get_axis_comm_lists("pipe")}
    if topology.get_dim("seq") > 1:
        groups["sequence"] = topology.get_axis_comm_lists("seq")
    if topology.get_dim("context") > 1:
        groups["context"] = topology.get_axis_comm_lists("context")
    if topology.get_dim("seq") * topology.get_dim("context") > 1:
        groups["sequence-data"] = sequence_data_parallel_lists(topology)
    return groups


def assert_matches_deepspeed_grid(grid):
    """DeepSpeed's PipelineParallelGrid must hold exactly our groups (it was built from deepspeed_topology):
    its data-parallel group is our sequence-data-parallel group."""
    ours = _groups()
    theirs = {"data": list(grid.dp_group), "pipeline": list(grid.pp_group), "tensor": list(grid.slice_group)}
    mine = {"data": ours.sequence_data_ranks, "pipeline": ours.pipeline_ranks, "tensor": ours.tensor_ranks}
    if theirs != mine:
        raise AssertionError(f"rank {dist.get_rank()}: DeepSpeed's pipeline grid groups {theirs} differ from "
                             f"megatron_ds parallel_state groups {mine}")


def assert_matches_deepspeed_engine(engine):
    """DeepSpeed's plain engine (PP 1) took its groups from our mpu: its data-parallel world must be our
    sequence-data-parallel group (SP x CP x DP) and its model-parallel world our TP group."""
    ours = (get_sequence_data_parallel_world_size(), get_tensor_model_parallel_world_size())
    theirs = (engine.dp_world_size, engine.mp_world_size)
    if theirs != ours:
        raise AssertionError(f"rank {dist.get_rank()}: DeepSpeed's engine has data-parallel x model-parallel sizes "
                             f"{theirs}, megatron_ds parallel_state {ours} (sequence-data-parallel x tensor)")


# Planning only: a simulated TP/PP position, so layers can be built (e.g. on the meta device) without any
# process group. Consulted first by the TP/PP world-size and rank getters; group getters raise under it.

@dataclass(frozen=True)
class _SimulatedParallelState:
    tensor_model_parallel_size: int
    tensor_model_parallel_rank: int
    pipeline_model_parallel_size: int
    pipeline_model_parallel_rank: int


_SIMULATED: Optional[_SimulatedParallelState] = None


@contextlib.contextmanager
def simulated_model_parallel(tensor_model_parallel_size: int = 1, tensor_model_parallel_rank: int = 0,
                             pipeline_model_parallel_size: int = 1, pipeline_model_parallel_rank: int = 0):
    """Within this block the TP/PP world-size and rank getters return the given values and no process group
    is needed (or usable: group getters raise). For planning tools only (tools/plan.py builds each pipeline
    stage of one TP rank on the meta device); never use it to train."""
    global _SIMULATED
    for size, rank, what in ((tensor_model_parallel_size, tensor_model_parallel_rank, "tensor"),
                             (pipeline_model_parallel_size, pipeline_model_parallel_rank, "pipeline")):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"simulated {what} model parallel rank {rank} is outside a group of size {size}")
    previous = _SIMULATED
    _SIMULATED = _SimulatedParallelState(tensor_model_parallel_size, tensor_model_parallel_rank,
                                         pipeline_model_parallel_size, pipeline_model_parallel_rank)
    try:
        yield
    finally:
        _SIMULATED = previous


# --- expert parallelism (MoE) -----------------------------------------------------------------------------

def expert_parallel_rank_lists(topology, expert_parallel_size, expert_tensor_parallel=False):
    """(expert-parallel groups, expert-data-parallel groups) as rank lists, DeepSpeed's layout: the ranks of each
    pipeline stage (TP fastest, then DP) are cut into consecutive runs of expert_parallel_size ranks that split
    the experts between them; the ranks at the same place in those runs hold the same experts and form an
    expert-data-parallel group. At TP > 1 a run crosses TP ranks: each TP rank sends its share of the tokens
    (DeepSpeed's MoE splits the dispatched tokens over TP) to the rank holding the expert.
    expert_tensor_parallel (experts sharded over TP): the same cut among the data-parallel ranks of each TP rank,
    since the TP ranks of a stage hold shards of the same experts (DeepSpeed's expert-model-parallel layout)."""
    parallel, data = [], []
    for stage in range(topology.get_dim("pipe")):
        slices = ([topology.filter_match(pipe=stage, model=tp) for tp in range(topology.get_dim("model"))]
                  if expert_tensor_parallel else [topology.filter_match(pipe=stage)])
        for ranks in map(sorted, slices):
            runs = [ranks[start:start + expert_parallel_size] for start in range(0, len(ranks), expert_parallel_size)]
            parallel += runs
            data += [list(column) for column in zip(*runs)]
    return parallel, data


def expert_group_name(expert_parallel_size):
    """DeepSpeed's name of the expert-parallel (and expert-data-parallel) groups of this size."""
    return f"ep_size_{expert_parallel_size}"


def initialize_expert_parallel(expert_parallel_size, expert_tensor_parallel=False):
    """Create the expert-parallel and expert-data-parallel groups from the topology (every rank, same order) and
    hand them to DeepSpeed under its name for them, so its MoE layers and engine use exactly these groups; with
    expert_tensor_parallel also DeepSpeed's expert TP size (its MoE then gathers each TP rank's tokens for the
    sharded experts, and its gradient norm sums the expert shards over TP)."""
    name = expert_group_name(expert_parallel_size)
    parallel, data = expert_parallel_rank_lists(get_topology(), expert_parallel_size, expert_tensor_parallel)
    deepspeed_internals.set_expert_tensor_parallel_world_size(
        get_tensor_model_parallel_world_size() if expert_tensor_parallel else 1)
    me = dist.get_rank()
    for lists, register in ((parallel, deepspeed_internals.register_expert_parallel_group),
                            (data, deepspeed_internals.register_expert_data_parallel_group)):
        for ranks in lists:
            group = dist.new_group(ranks=ranks)
            if me in ranks:
                register(name, group, ranks)


def expert_parallel_group(expert_parallel_size):
    """This rank's expert-parallel process group of that size (initialize_expert_parallel made it), None at EP 1."""
    if expert_parallel_size == 1:
        return None
    return deepspeed_internals.expert_parallel_group(expert_group_name(expert_parallel_size))


def expert_groups_by_axis(expert_parallel_size, expert_tensor_parallel=False):
    """{'expert': [...], 'expert-data': [...]}: every expert group's ranks, for start-up logs."""
    parallel, data = expert_parallel_rank_lists(get_topology(), expert_parallel_size, expert_tensor_parallel)
    return {"expert": parallel, "expert-data": data}
