"""tools/dry_run.py: a launch checked on this machine before it is queued. The flags are resolved and checked
once, the planner plans them, then each chosen rank runs pretrain.py's start-up (start_up) in a process
of its own (forked from one of J workers that did the imports) on torch's fake process group, the model under
FakeTensorMode (planning/dry_run/fake_rank.py), and what the ranks built is checked against each other and against the
plan:

  - every rank created the same process groups in the same order (torch's rule; a difference deadlocks a real
    launch at its first collective on the group);
  - each of a rank's groups (tensor, data, pipeline, sequence, sequence-data; with MoE expert and expert-data)
    holds the rank, and every member of it that ran has the same member list for that axis; DeepSpeed's pipeline
    grid holds exactly our groups;
  - each rank's parameters equal the planner's for its stage exactly, and so do the bytes of its weights.

--ranks stages (the default) runs the start-up of one rank per (pipeline stage, position in the TP group) class,
the ranks of data-parallel replica 0 (every replica builds the same); --ranks 0,5,8-11 that of those ranks;
--ranks all creates every rank's process groups and DeepSpeed's pipeline grid (not the model: the group checks),
many ranks to a process; --ranks all --step runs every rank's whole start-up and iteration.
"""
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_ds.arguments import ArgumentsError, build_parser, parse_flags, raise_if_invalid
from megatron_ds.core import parallel_state
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning import report
from megatron_ds.planning.dry_run import step_checks
from megatron_ds.planning.from_flags import layout_from_args, model_spec
from megatron_ds.planning.memory import GIB
from megatron_ds.planning.model import Cluster, fp8_device_errors
from megatron_ds.planning.plan_cli import add_cluster_flags, validated_args
from megatron_ds.planning.planner import make_plan

# The rank processes' device environment: the fake process group and fake tensors run on the CPU, and DeepSpeed
# reads its accelerator when it is imported, so the environment gives it before the process starts
FAKE_RANK_DEVICE_ENVIRONMENT = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
# what a rank worker (fake_rank.py) prints when it is done with a rank, followed by the rank
DONE = "fake_rank: done rank "


def build_dry_run_parser():
    parser = build_parser(prog="tools/dry_run.py")
    parser.description = ("Run pretrain.py's start-up for chosen ranks of a world this machine does not have, on "
                          "a fake process group, and check the ranks against each other and the planner")
    group = parser.add_argument_group("dry run")
    add_cluster_flags(group)
    group.add_argument("--ranks", default="stages",
                       help="stages (one rank per pipeline stage and TP position), all, or a list: 0,5,8-11")
    group.add_argument("--step", action="store_true",
                       help="also run one iteration per rank and check its collectives, sends and traffic")
    group.add_argument("--micro-batches", type=int, default=None,
                       help="micro-batches of the --step iteration (default: the first batch's)")
    group.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ranks run at once")
    group.add_argument("--json", metavar="FILE", default=None, help="also write the records and checks here")
    group.add_argument("--start-anyway", action="store_true",
                       help="start the ranks even where the planner puts a stage over the device's memory (without "
                            "it the dry run answers at once, naming the stages and both figures)")
    parser.set_defaults(search=False)  # what planning/plan_cli.validated_args reads
    return parser


def resolve_flags(argv):
    """pretrain.py's resolution of the flags for the launch's cluster (planning/plan_cli.validated_args: nothing is
    checked against this machine)."""
    flags, problems = parse_flags(build_dry_run_parser(), argv)
    raise_if_invalid(problems)
    return validated_args(flags)


def option_problems(args):
    problems = []
    if args.micro_batches is not None and (args.micro_batches < 1 or not args.step):
        problems.append(f"--micro-batches {args.micro_batches}: the micro-batches of the --step iteration, at least "
                        f"1, and only with --step")
    if args.jobs < 1:
        problems.append(f"--jobs {args.jobs} must be at least 1")
    try:
        chosen_ranks(args.ranks, None, args.world_size)
    except ValueError as error:
        problems.append(str(error))
    return problems


def chosen_ranks(selection, topology, world_size):
    """The ranks --ranks names (topology: for 'stages'; None only checks the spelling)."""
    if selection == "all":
        return list(range(world_size))
    if selection == "stages":
        if topology is None:
            return []
        return sorted(topology.filter_match(pipe=pipe, model=model, data=0, seq=0)[0]
                      for pipe in range(topology.get_dim("pipe")) for model in range(topology.get_dim("model")))
    ranks = []
    for part in selection.split(","):
        first, _, last = part.partition("-")
        if not (first.strip().isdigit() and (not last or last.strip().isdigit())):
            raise ValueError(f"--ranks {selection!r}: expected stages, all or a list like 0,5,8-11 ({part!r})")
        ranks += range(int(first), int(last or first) + 1)
    outside = sorted(rank for rank in set(ranks) if rank >= world_size)
    if outside:
        raise ValueError(f"--ranks {selection!r}: ranks {outside} are outside the world of {world_size}")
    return sorted(set(ranks))


def run_ranks(ranks, argv, args, folder):
    """Each rank's record, or its failure (the end of its output), on --jobs workers (fake_rank.py processes that
    each pay the imports once) taking the next rank as each becomes free: the whole start-up, or for --ranks all
    without --step the process groups only. A worker that dies fails the rank it held; a new one takes the next."""
    groups_only = args.ranks == "all" and not args.step
    command = [sys.executable, "-m", "megatron_ds.planning.dry_run.fake_rank", "groups" if groups_only else "start-up",
               str(args.world_size), str(args.gpus_per_node), folder,
               *(["--digest"] if groups_only else []), "--", *argv]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _repository_path(),
                   **FAKE_RANK_DEVICE_ENVIRONMENT}
    waiting = queue.SimpleQueue()
    for rank in ranks:
        waiting.put(rank)

    def serve(_):
        records, worker = {}, None
        for rank in _taken(waiting):
            worker = worker or _RankWorker(command, environment)
            answered = worker.run(rank)
            records[rank] = _record_or_failure(folder, rank, None if answered else worker.close())
            if not answered:
                worker = None
        if worker is not None:
            worker.close()
        return records

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return {rank: record for records in pool.map(serve, range(min(args.jobs, len(ranks))))
                for rank, record in records.items()}


def _taken(waiting):
    while True:
        try:
            yield waiting.get_nowait()
        except queue.Empty:
            return


class _RankWorker:
    """A fake_rank.py process reading ranks from its stdin and answering each on its stdout (DONE); what else it
    prints (its own warnings, its traceback if it dies) is kept for a failure's message."""

    def __init__(self, command, environment):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=environment)
        self.output = []

    def run(self, rank):
        """Whether the worker answered for rank (False: it died first)."""
        try:
            self.process.stdin.write(f"{rank}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass
        for line in self.process.stdout:
            if line.rstrip("\n") == f"{DONE}{rank}":
                return True
            self.output.append(line)
        return False

    def close(self):
        """Ends the worker; everything it printed of its own."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        self.output += self.process.stdout.readlines()
        self.process.wait()
        return "".join(self.output)


def _record_or_failure(folder, rank, worker_output):
    """rank's record; else its failure: the end of its own log where its start-up failed, else of its worker's
    output (worker_output: None where the worker answered for it)."""
    path = os.path.join(folder, f"rank{rank}.json")
    if os.path.exists(path):
        with open(path) as handle:
            return json.load(handle)
    log = os.path.join(folder, f"rank{rank}.log")
    if os.path.exists(log):  # its start-up failed
        with open(log) as handle:
            return {"failed": _last_lines(handle.read())}
    return {"failed": "no record" if worker_output is None else _last_lines(worker_output)}


def _repository_path():
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))


def _last_lines(output, count=12):
    lines = [line for line in output.splitlines() if "[WARNING]" not in line and line.strip()]
    return "\n".join(lines[-count:])


# --- the checks ---------------------------------------------------------------------------------------------

def group_creation_problems(records):
    """Every rank must have created the same groups in the same order."""
    ranks = sorted(records)
    first = records[ranks[0]]
    problems = []
    for rank in ranks[1:]:
        record = records[rank]
        if "new_groups" in record:
            calls, reference = record["new_groups"], first["new_groups"]
            if calls != reference:
                index = next((i for i, (a, b) in enumerate(zip(calls, reference)) if a != b),
                             min(len(calls), len(reference)))
                problems.append(f"ranks {ranks[0]} and {rank} create different process groups: group {index} is "
                                f"{_at(reference, index)} on rank {ranks[0]} and {_at(calls, index)} on rank "
                                f"{rank} ({len(reference)} and {len(calls)} groups in all)")
        elif record["new_groups_digest"] != first["new_groups_digest"]:
            problems.append(f"ranks {ranks[0]} and {rank} create different process groups ({first['new_groups_count']}"
                            f" and {record['new_groups_count']} groups); --ranks {ranks[0]},{rank} names the first "
                            f"that differs")
    return problems


def _at(calls, index):
    return calls[index] if index < len(calls) else "(none)"


def membership_problems(records):
    """Each group by axis holds its rank and is the same list on every member that ran; DeepSpeed's grid holds
    the same groups as ours."""
    problems = []
    for rank, record in sorted(records.items()):
        ours, theirs = record["groups"]["ours"], record["groups"]["deepspeed"]
        for axis, members in ours.items():
            if rank not in members:
                problems.append(f"rank {rank}'s {axis} group {members} does not hold it")
            for member in members:
                if member in records and records[member]["groups"]["ours"].get(axis) != members:
                    problems.append(f"rank {rank}'s {axis} group is {members}, rank {member}'s is "
                                    f"{records[member]['groups']['ours'].get(axis)}")
            if "new_groups" in record and len(members) > 1 and \
                    not any(call is not None and sorted(call) == sorted(members) for call in record["new_groups"]):
                problems.append(f"rank {rank}'s {axis} group {members} was never created")
        if theirs is not None:
            expected = {"data": ours["sequence-data"], "pipeline": ours["pipeline"], "tensor": ours["tensor"]}
            if theirs != expected:
                problems.append(f"rank {rank}: DeepSpeed's pipeline grid groups {theirs} differ from ours {expected}")
    return problems


def plan_problems(records, plan, weight_bytes_per_parameter):
    """Each rank's parameters and weight bytes against the planner's for its stage."""
    per_stage = {row["stage"]: row for row in plan["parameters"]["per_stage"]}
    problems = []
    for rank, record in sorted(records.items()):
        stage = record["coordinates"]["pipe"]
        planned = per_stage[stage]["per_device"]
        if record["parameters"] != planned:
            problems.append(f"rank {rank} (stage {stage}): {record['parameters']:,} parameters, the planner "
                            f"{planned:,}")
        if record["bytes"]["weights"] != planned * weight_bytes_per_parameter:
            problems.append(f"rank {rank} (stage {stage}): {record['bytes']['weights']:,} bytes of weights, the "
                            f"planner {planned * weight_bytes_per_parameter:,}")
        if record["layers"] != per_stage[stage]["layers"]:
            held = "no transformer layer: a pipeline stage without layers" if record["layers"] == 0 else \
                f"{record['layers']} transformer layers"
            problems.append(f"rank {rank} (stage {stage}): {held}, the planner {per_stage[stage]['layers']}")
    return problems


def step_problems(records, model, layout, device):
    """--step: the iterations' point-to-point pairing, collective sequences, traffic and memory against the
    planner, memory against the device; prints the table and what was covered."""
    micro_batches = next(iter(records.values()))["step"]["micro_batches"]
    planned = step_checks.planned_traffic(model, layout, micro_batches)
    memory = step_checks.planned_memory(model, layout, micro_batches)
    recorded = {rank: step_checks.recorded_traffic(record) for rank, record in records.items()}
    print(f"one iteration of {micro_batches} micro-batches: MiB each rank sent per axis and the MiB it holds at "
          f"its peak (the planner's, without its runtime overhead)")
    for line in step_checks.traffic_table(records, recorded, planned, memory):
        print(line)
    pairing, pairs, unmatched = step_checks.point_to_point_problems(records)
    sequences, groups, alone = step_checks.collective_sequence_problems(records)
    ops = sum(len(record["step"]["ops"]) for record in records.values())
    print(f"checked {ops:,} ops: {pairs} sending pairs ({unmatched} whose receiver did not run), {groups} groups "
          f"with two or more members that ran ({alone} with one)")
    return (pairing + sequences + step_checks.traffic_problems(records, recorded, planned)
            + step_checks.memory_problems(records, memory, device))


# --- the report ---------------------------------------------------------------------------------------------

def stage_table(records, plan):
    per_stage = {row["stage"]: row for row in plan["parameters"]["per_stage"]}
    memory = {row["stage"]: row for row in plan["memory"]["per_stage"]}
    lines = [f"{'stage':>5}  {'ranks run':>9}  {'layers':>6}  {'parameters per device (planner)':>34}  "
             f"{'weights (planner)':>21}  optimizer at start-up (the planner's gradients + optimizer at the "
             f"first step)"]
    for stage in sorted(per_stage):
        ran = [record for record in records.values() if record["coordinates"]["pipe"] == stage]
        if not ran:
            continue
        first, planned = ran[0], memory[stage]
        states = planned["gradients"] + planned["grad_accumulation"] + planned["optimizer"]
        lines.append(f"{stage:>5}  {len(ran):>9}  {first['layers']:>6}  {first['parameters']:>15,} "
                     f"({per_stage[stage]['per_device']:>15,})  {report.human_bytes(first['bytes']['weights']):>10} "
                     f"({report.human_bytes(planned['weights']):>9})  "
                     f"{report.human_bytes(first['bytes']['optimizer'])} ({report.human_bytes(states)})")
    return lines


def covered_classes(records, topology):
    """How many (stage, TP position) classes ran, of how many."""
    classes = {(record["coordinates"]["pipe"], record["coordinates"]["model"]) for record in records.values()}
    return len(classes), topology.get_dim("pipe") * topology.get_dim("model")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    try:
        args = resolve_flags(argv)
        problems = option_problems(args) + fp8_device_errors(model_spec(args), device_spec(args.device))
        raise_if_invalid(problems)
    except ArgumentsError as error:
        print(error, file=sys.stderr)
        return 2
    model, layout = model_spec(args), layout_from_args(args)
    device = device_spec(args.device)
    plan = make_plan(model, layout, Cluster(device, args.world_size, args.gpus_per_node, args.peak_tflops))
    if plan["errors"]:
        print("the planner refuses the layout:\n  - " + "\n  - ".join(text for _, text in plan["errors"]),
              file=sys.stderr)
        return 2
    if not plan["memory"]["fits"] and not args.start_anyway:  # no rank needs to start for this answer
        print(over_memory_message(plan["memory"], device), file=sys.stderr)
        return 1
    topology = parallel_state.topology_of(args.parallel)
    ranks = chosen_ranks(args.ranks, topology, args.world_size)
    print(f"dry run: {len(ranks)} of {args.world_size} ranks ({args.ranks}), {args.jobs} at a time, on a fake "
          f"process group; {layout.describe()}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        records = run_ranks(ranks, argv, args, folder)
    failed = {rank: record["failed"] for rank, record in records.items() if "failed" in record}
    ran = {rank: record for rank, record in records.items() if "failed" not in record}
    problems = [f"rank {rank} failed its start-up:\n{text}" for rank, text in sorted(failed.items())]
    started = {rank: record for rank, record in ran.items() if "parameters" in record}
    if ran:
        problems += group_creation_problems(ran) + membership_problems(ran)
    if started:
        problems += plan_problems(started, plan, 4 if model.precision == "fp32" else 2)
        for line in stage_table(started, plan):
            print(line)
    if args.step and started:
        problems += step_problems(started, model, layout, device)
    done, classes = covered_classes(ran, topology) if ran else (0, 0)
    groups = ran[min(ran)].get("new_groups_count", len(ran[min(ran)].get("new_groups", []))) if ran else 0
    print(f"covered {done} of {classes} (pipeline stage, TP position) classes with {len(ran)} ranks"
          f"{' (process groups only)' if len(started) < len(ran) else ''}; {groups} process groups per rank; "
          f"{time.perf_counter() - start:.0f} s")
    if args.json:
        _write_json(args.json, {"ranks": {str(rank): record for rank, record in records.items()},
                                "problems": problems, "plan": plan})
    if problems:
        print("dry run FAILED:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    print("dry run passed: every group formed alike on its members and equal to DeepSpeed's grid"
          + ("; each stage's parameters as planned" if started else "")
          + ("; every send received, every group's collectives alike on its members, traffic and memory as "
             "planned, memory within the device" if args.step and started else ""))
    return 0


def over_memory_message(memory, device):
    """The stages the planner puts over the device's memory, each with both figures: what the dry run answers
    before any rank starts."""
    over = [row for row in memory["per_stage"] if row["total"] > memory["capacity_bytes"]]
    stages = "; ".join(f"stage {row['stage']}: {row['total'] / GIB:,.1f} GiB" for row in over)
    return (f"dry run FAILED before any rank started: the planner puts {len(over)} pipeline stage(s) over the "
            f"{device.name}'s {device.memory_gib:g} GiB ({stages}; the largest, stage {memory['peak_stage']}, by "
            f"{-memory['margin_bytes'] / GIB:,.1f} GiB). tools/plan.py shows each stage's terms; less memory: "
            f"recompute (--recompute-granularity), a smaller --micro-batch-size, more TP or PP, ZeRO")


def _write_json(path, content):
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(content, handle, indent=1)
    os.replace(temporary, path)


if __name__ == "__main__":
    sys.exit(main())
