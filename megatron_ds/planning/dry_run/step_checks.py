"""tools/dry_run.py --step: the checks across ranks of the iterations the ranks ran (planning/dry_run/fake_step.py), and
their traffic beside the planner's.

  - every send has its receive: rank r's sends to rank q, in order, are rank q's receives from r (bytes, and the
    values of an integer message); a difference is a deadlock or a wrong shape on the real machines;
  - the members of a group issue the same collectives on it in the same order with the same sizes (a member
    with one more or one fewer waits forever: the deadlock a real launch meets without a message);
  - the bytes each rank sends per axis (tensor, pipeline, data, tied embedding, Ulysses, context, expert) equal the
    planner's communication model (planning/communication.stage_traffic_per_iteration) within 1%; the dropless
    MoE layer's all-to-all-v on the expert axis as its splits send them under the dry run's uniform routing
    (dry_run/fake_step.py), the planner's (EP - 1)/EP of the rows;
  - what each rank holds at its peak (the start-up's allocations, what the first iteration made and kept:
    Adam's moments, and the iteration's transient peak: gradients, activations, recompute) equals the planner's
    memory for its stage (planning/memory.py, without the runtime overhead it assumes for a GPU) within 5%, and
    with that overhead fits the device. Attention on fake tensors keeps what a GPU's flash kernel keeps
    (core/fusions/flash_attention.flash_attention_footprint), not the s x s scores of the CPU's math path.
Pairs and groups whose other members did not run are counted and reported, not checked.
"""
import collections
import dataclasses

from megatron_ds.planning import communication as comm
from megatron_ds.planning.memory import GIB, RUNTIME_OVERHEAD_BYTES, memory_per_stage
from megatron_ds.planning.parameters import rank_parameters

TRAFFIC_TOLERANCE = 0.01
MEMORY_TOLERANCE = 0.05
POINT_TO_POINT = ("send", "recv")


def _messages(record, op, peer):
    return [(entry["bytes"], entry.get("values")) for entry in record["step"]["ops"]
            if entry["op"] == op and entry["peer"] == peer]


def point_to_point_problems(records):
    """(problems, pairs checked, pairs whose other end did not run)."""
    problems, checked, unmatched = [], 0, 0
    for rank, record in sorted(records.items()):
        for peer in sorted({entry["peer"] for entry in record["step"]["ops"] if entry["op"] == "send"}):
            if peer not in records:
                unmatched += 1
                continue
            checked += 1
            problems += _pair_problems(rank, _messages(record, "send", peer), peer,
                                       _messages(records[peer], "recv", rank))
    for rank, record in sorted(records.items()):   # receives from a rank that ran and sent nothing
        for peer in sorted({entry["peer"] for entry in record["step"]["ops"] if entry["op"] == "recv"}):
            if peer in records and not _messages(records[peer], "send", rank):
                problems.append(f"rank {rank} receives {len(_messages(record, 'recv', peer))} messages from rank "
                                f"{peer}, which sends it none")
    return problems, checked, unmatched


def _pair_problems(rank, sends, peer, receives):
    for index, (sent, received) in enumerate(zip(sends, receives)):
        if sent != received:
            return [f"rank {rank}'s send {index + 1} to rank {peer} is {_message(sent)}, rank {peer}'s receive "
                    f"{index + 1} from rank {rank} is {_message(received)}"]
    if len(sends) != len(receives):
        return [f"rank {rank} sends {len(sends)} messages to rank {peer}, which receives {len(receives)} from it"]
    return []


def _message(message):
    size, values = message
    return f"{size:,} bytes" + ("" if values is None else f" {values}")


def _collectives(record):
    """{group (tuple of ranks): [(op, bytes), ...]} of the rank's collectives, in order."""
    sequences = collections.defaultdict(list)
    for entry in record["step"]["ops"]:
        if entry["op"] not in POINT_TO_POINT:
            sequences[tuple(entry["group"])].append((entry["op"], entry["bytes"]))
    return sequences


def collective_sequence_problems(records):
    """(problems, groups checked, groups with one member that ran)."""
    sequences = {rank: _collectives(record) for rank, record in records.items()}
    groups = sorted({group for per_rank in sequences.values() for group in per_rank})
    problems, checked, alone = [], 0, 0
    for group in groups:
        members = [rank for rank in group if rank in records]
        if len(members) < 2:
            alone += 1
            continue
        checked += 1
        first = members[0]
        for member in members[1:]:
            problem = _sequence_difference(group, first, sequences[first].get(group, []), member,
                                           sequences[member].get(group, []))
            if problem:
                problems.append(problem)
                break
    return problems, checked, alone


def _sequence_difference(group, first, ours, member, theirs):
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return (f"group {list(group)}: collective {index + 1} is {a[0]} of {a[1]:,} bytes on rank {first} and "
                    f"{b[0]} of {b[1]:,} bytes on rank {member} ({len(ours)} and {len(theirs)} collectives on it "
                    f"in all): a real launch hangs or mixes the data up there")
    if len(ours) != len(theirs):
        longer, rank = (ours, first) if len(ours) > len(theirs) else (theirs, member)
        extra = longer[min(len(ours), len(theirs))]
        return (f"group {list(group)}: rank {first} issues {len(ours)} collectives on it, rank {member} "
                f"{len(theirs)}; the first unmatched is rank {rank}'s {extra[0]} of {extra[1]:,} bytes: the other "
                f"members would wait for it forever")
    return None


def _axis(entry, groups):
    """The axis of one recorded op on a rank with `groups` (its record's groups by axis, ours)."""
    if entry["op"] in POINT_TO_POINT:
        return "context" if entry["peer"] in groups.get("context", ()) else "pipeline"
    ranks = entry["group"]
    # CP's allgather exchange is the list all-gather and reduce-scatter, which DeepSpeed's reduction and ZeRO (on the
    # same ranks at U = DP = 1) do not use
    if entry["op"] in ("allgather", "reduce_scatter") and groups.get("context") == ranks:
        return "context"
    # an all-to-all is MoE's or Ulysses' even where their group's ranks are another's too (TP's; at DP 1 the
    # sequence-data group's)
    for axis, name in (("expert", "expert"), ("sequence", "ulysses")):
        if entry["op"].startswith("alltoall") and groups.get(axis) == ranks:
            return name
    if entry["op"] == "allreduce" and ranks == groups.get("tied"):
        return "tied"   # DeepSpeed's tie group (at PP 2 the pipeline group's ranks too)
    for axis, name in (("tensor", "tensor"), ("sequence-data", "data"), ("sequence", "ulysses"),
                       ("expert", "expert"), ("expert-data", "data"), ("pipeline", "pipeline collectives")):
        if len(ranks) > 1 and groups.get(axis) == ranks:
            return name
    return "other"


def recorded_traffic(record):
    """{axis: bytes this rank sent in its iteration} (the ring model's bytes of each op)."""
    groups = record["groups"]["ours"]
    traffic = collections.defaultdict(float)
    for entry in record["step"]["ops"]:
        traffic[_axis(entry, groups)] += entry["sent"]
    return dict(traffic)


def _with_micro_batches(layout, micro_batches):
    return dataclasses.replace(layout, global_batch_size=micro_batches * layout.micro_batch_size * layout.dp)


def planned_traffic(model, layout, micro_batches):
    """{stage: {axis: bytes}} the planner's, for an iteration of `micro_batches`."""
    layout = _with_micro_batches(layout, micro_batches)
    return {stage.stage: comm.stage_traffic_per_iteration(model, layout, stage)
            for stage in rank_parameters(model, layout)}


def planned_memory(model, layout, micro_batches):
    """{stage: bytes} the planner's memory per device without its runtime overhead, for `micro_batches`; without a
    --kd teacher's share too (the dry run reads no teacher: it checks the student's memory)."""
    layout = _with_micro_batches(layout, micro_batches)
    return {stage.stage: stage.total - stage.overhead - stage.teacher
            for stage in memory_per_stage(model, layout, rank_parameters(model, layout))}


def recorded_memory(record):
    """What the rank holds at the peak of an iteration after its first (the module docstring's sum)."""
    return (record["bytes"]["weights"] + record["bytes"]["optimizer"] + record["step"]["held_bytes"] +
            record["step"]["transient_peak_bytes"])


def memory_problems(records, planned, device):
    """Each rank's peak against the planner's for its stage, and with the runtime overhead against the device."""
    problems = []
    for rank, record in sorted(records.items()):
        stage = record["coordinates"]["pipe"]
        ours, theirs = recorded_memory(record), planned[stage]
        if abs(ours - theirs) > MEMORY_TOLERANCE * max(ours, theirs):
            problems.append(f"rank {rank} (stage {stage}) holds {_mib(ours)} MiB at its peak, the planner "
                            f"{_mib(theirs)} MiB for its stage ({_ratio(ours, theirs)})")
        if ours + RUNTIME_OVERHEAD_BYTES > device.memory_gib * GIB:
            problems.append(f"rank {rank} (stage {stage}) holds {ours / GIB:.2f} GiB at its peak, "
                            f"{(ours + RUNTIME_OVERHEAD_BYTES) / GIB:.2f} GiB with the "
                            f"{RUNTIME_OVERHEAD_BYTES / GIB:g} GiB the planner assumes for the CUDA context and "
                            f"buffers: more than the {device.name}'s {device.memory_gib:g} GiB")
    return problems


PLANNED_AXES = ("tensor", "pipeline", "data", "tied", "ulysses", "context", "expert")


def traffic_problems(records, recorded, planned):
    """recorded: {rank: recorded_traffic of its record}."""
    problems = []
    for rank, record in sorted(records.items()):
        stage = record["coordinates"]["pipe"]
        for axis in PLANNED_AXES:
            ours, theirs = recorded[rank].get(axis, 0.0), planned[stage][axis]
            if abs(ours - theirs) > TRAFFIC_TOLERANCE * max(ours, theirs):
                problems.append(f"rank {rank} (stage {stage}) sends {ours:,.0f} bytes on the {axis} axis in its "
                                f"iteration, the planner {theirs:,.0f} ({_ratio(ours, theirs)})")
    return problems


def _ratio(ours, theirs):
    return f"{ours / theirs:.3f}x" if theirs else "the planner none"


def _mib(size):
    return f"{size / 2 ** 20:,.3f}"


def traffic_table(records, recorded, planned, planned_bytes):
    """One line per stage (its first rank that ran): each axis's recorded MiB (the planner's), and the memory at
    its peak (the planner's)."""
    axes = [axis for axis in PLANNED_AXES if any(planned[stage][axis] for stage in planned)
            or any(sent.get(axis) for sent in recorded.values())]
    lines = [f"{'stage':>5}  {'rank':>5}  " + "  ".join(f"{axis + ' (planner)':>23}" for axis in axes)
             + f"  {'peak (planner)':>23}  other collectives (MiB)"]
    for stage in sorted(planned):
        ran = sorted(rank for rank, record in records.items() if record["coordinates"]["pipe"] == stage)
        if not ran:
            continue
        sent = recorded[ran[0]]
        cells = [f"{_mib(sent.get(axis, 0.0)):>10} ({_mib(planned[stage][axis]):>10})" for axis in axes]
        memory = f"{_mib(recorded_memory(records[ran[0]])):>10} ({_mib(planned_bytes[stage]):>10})"
        other = sent.get("other", 0.0) + sent.get("pipeline collectives", 0.0)
        lines.append(f"{stage:>5}  {ran[0]:>5}  " + "  ".join(cells) + f"  {memory}  {_mib(other)}")
    return lines
