"""The pipeline schedules, as the order in which each pipeline rank runs its work, and a simulation of that
order: one description that the planner times and the pipeline engine will execute.

A rank's work is a list of `Op`s: the forward (F) of a micro-batch through one of its chunks (model stages),
the backward of it - whole (BW), or split into the input gradient (B) and the weight gradient (W) that may
wait - in the order the rank runs them. The schedules:

  1f1b         DeepSpeed's TrainSchedule (PipeDream-flush): p - r - 1 warm-up forwards on rank r, then one
               forward and one whole backward in turn, then the remaining backwards.
  zbh1         zero-bubble ZB-H1 (Qi et al. 2023): 1F1B's order with each backward split, rank r taking each W
               r ops after its B; every rank holds at most p forwards in flight (1F1B's first rank's peak).
  interleaved  Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): v chunks per rank (model stage c x p + r),
               micro-batches in groups of p per chunk, (p - r - 1) x 2 + (v - 1) x p warm-up forwards.
  dualpipev    DeepSeek's DualPipeV (the V-shaped half of DualPipe; DeepSpeed's DualPipeVSchedule): two chunks
               per rank, model stages r and 2p - 1 - r, in DualPipe's eight steps, the W's of its last steps
               deferred into the end of the pipeline (zero bubble there; DeepSpeed keeps them in the backward).

`simulate` runs the lists as a dataflow (an op starts when its rank is free and its inputs have arrived) with
given per-chunk F, B and W times and a p2p latency, and returns each rank's busy and idle time, the makespan
and the activations held in flight: the planner's bubble and memory per schedule, and a check that a
schedule cannot deadlock.
"""
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

SCHEDULES = ("1f1b", "zbh1", "interleaved", "dualpipev")
FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "BW", "B", "W"
ONE_STAGE_PER_RANK = "one stage per rank"


@dataclass(frozen=True)
class Op:
    kind: str          # F, BW (whole backward), B (input gradient) or W (weight gradient)
    micro_batch: int
    chunk: int = 0     # which of the rank's chunks (interleaved: v of them; dualpipev: 2)


# --- which model stage a rank's chunk holds ------------------------------------------------------------

def chunks_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    return {"interleaved": virtual_stages, "dualpipev": 2}.get(schedule, 1)


def model_stage(schedule: str, ranks: int, rank: int, chunk: int) -> int:
    """The model stage (0 = the embedding's) that chunk `chunk` of pipeline rank `rank` holds."""
    if schedule == "dualpipev":
        return rank if chunk == 0 else 2 * ranks - 1 - rank
    return chunk * ranks + rank


def pipeline_rank_of(schedule: str, ranks: int, stage: int, virtual_stages: int = 1) -> int:
    """The pipeline rank that holds model stage `stage` (the inverse of model_stage)."""
    if schedule == "dualpipev":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def messages_split_over_tensor_parallel(schedule: str, sequence_parallel: bool) -> bool:
    """Whether DeepSpeed's pipeline engine splits each activation and gradient it sends over the TP ranks
    (pipe_partitioned / grad_partitioned, its default; the receiving stage all-gathers it over TP). Off with
    Megatron's sequence parallelism, where each TP rank holds other tokens, and under DualPipeVEngine (dualpipev and
    interleaved here), which asserts it off."""
    return not sequence_parallel and schedule not in ("dualpipev", "interleaved")


def pipeline_messages_per_micro_batch(schedule: str, ranks: int, rank: int, virtual_stages: int = 1) -> dict:
    """Per micro-batch, what pipeline rank `rank` sends to and receives from other ranks: {'send_activation',
    'send_gradient', 'receive_activation', 'receive_gradient'}, one per model-stage boundary it sits on that
    crosses to another rank (1F1B: a middle rank one of each, rank 0 sends activations and receives gradients
    only)."""
    counts = dict.fromkeys(("send_activation", "send_gradient", "receive_activation", "receive_gradient"), 0)
    last = ranks * chunks_per_rank(schedule, virtual_stages) - 1
    for chunk in range(chunks_per_rank(schedule, virtual_stages)):
        stage = model_stage(schedule, ranks, rank, chunk)
        if stage < last and pipeline_rank_of(schedule, ranks, stage + 1, virtual_stages) != rank:
            counts["send_activation"] += 1
            counts["receive_gradient"] += 1
        if stage > 0 and pipeline_rank_of(schedule, ranks, stage - 1, virtual_stages) != rank:
            counts["receive_activation"] += 1
            counts["send_gradient"] += 1
    return counts


def stage_placement(schedule: str, virtual_stages: int = 1) -> str:
    """How the model's stages lie on the pipeline ranks, as a checkpoint's layout records it: a checkpoint saved
    with another placement holds other layers per rank and is resharded on load."""
    chunks = chunks_per_rank(schedule, virtual_stages)
    if chunks == 1:
        return ONE_STAGE_PER_RANK
    return f"{schedule}: {chunks} stages per rank"


def placement_note(placement: str) -> str:
    """', <placement>' for a load line, empty for one stage per rank."""
    return "" if placement == ONE_STAGE_PER_RANK else f", {placement}"


def nearest_multiples(value: int, of: int) -> List[int]:
    """The positive multiples of `of` just below and above value."""
    return sorted({n for n in (value // of * of, -(-value // of) * of) if n > 0})


# --- the rules a schedule imposes on the layout and the batch -------------------------------------------

def schedule_problems(schedule: str, ranks: int, virtual_stages: int = 1) -> List[str]:
    """Why the schedule cannot run on `ranks` pipeline ranks (the layers' split into its chunks is the layout's
    rule: core/parallel_layout.py)."""
    if schedule not in SCHEDULES:
        return [f"--pipeline-schedule {schedule}: choose one of {', '.join(SCHEDULES)}"]
    if schedule != "1f1b" and ranks < 2:
        return [f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size 2 or more (it is {ranks}): "
                f"with one stage there is no pipeline to schedule"]
    if schedule == "interleaved" and virtual_stages < 2:
        return [f"the interleaved schedule needs 2 or more virtual stages per pipeline rank (it has "
                f"{virtual_stages}): give --num-virtual-stages-per-pipeline-rank or "
                f"--num-layers-per-virtual-pipeline-stage"]
    return []


def micro_batch_problems(schedule: str, ranks: int, micro_batches: int) -> List[str]:
    """Why the schedule cannot run `micro_batches` micro-batches per iteration, with the nearest valid counts."""
    if schedule == "interleaved" and ranks > 1 and micro_batches % ranks:
        near = nearest_multiples(micro_batches, ranks)
        return [f"the interleaved schedule needs the micro-batches per iteration ({micro_batches}: global batch / "
                f"(micro batch x data-parallel size)) to be a multiple of --pipeline-model-parallel-size {ranks} "
                f"(nearest: {', '.join(map(str, near))})"]
    if schedule == "dualpipev" and micro_batches < 2 * ranks:
        return [f"the dualpipev schedule needs at least 2 x --pipeline-model-parallel-size = {2 * ranks} "
                f"micro-batches per iteration (it has {micro_batches}: global batch / (micro batch x data-parallel "
                f"size))"]
    return []


# --- each rank's order -------------------------------------------------------------------------------------

def stage_order(schedule: str, ranks: int, micro_batches: int, rank: int, virtual_stages: int = 1) -> List[Op]:
    """The ops pipeline rank `rank` runs in one iteration, in order."""
    if schedule == "1f1b":
        return _one_forward_one_backward(ranks, micro_batches, rank)
    if schedule == "zbh1":
        return _zero_bubble_h1(ranks, micro_batches, rank)
    if schedule == "interleaved":
        return _interleaved(ranks, micro_batches, rank, virtual_stages)
    if schedule == "dualpipev":
        return _dualpipev(ranks, micro_batches, rank)
    raise ValueError(f"unknown pipeline schedule {schedule!r} (known: {', '.join(SCHEDULES)})")


def _one_forward_one_backward(ranks, micro_batches, rank):
    warmup = min(ranks - rank - 1, micro_batches)
    order = [Op(FORWARD, mb) for mb in range(warmup)]
    for mb in range(warmup, micro_batches):
        order += [Op(FORWARD, mb), Op(BACKWARD, mb - warmup)]
    return order + [Op(BACKWARD, mb) for mb in range(micro_batches - warmup, micro_batches)]


def _zero_bubble_h1(ranks, micro_batches, rank):
    """1F1B's warm-up and 1F1B's order of forwards and input gradients; rank r takes each W r ops after its B
    (the last rank defers the most), so a rank holds at most p forwards' activations, as 1F1B's first rank
    does, and the input gradients travel up the pipeline without waiting for weight gradients."""
    warmup = min(ranks - rank - 1, micro_batches)
    order = [Op(FORWARD, mb) for mb in range(warmup)]
    pending: List[int] = []

    def input_grad(mb):
        order.append(Op(INPUT_GRAD, mb))
        pending.append(mb)
        if len(pending) > rank:
            order.append(Op(WEIGHT_GRAD, pending.pop(0)))

    for mb in range(warmup, micro_batches):
        order.append(Op(FORWARD, mb))
        input_grad(mb - warmup)
    for mb in range(micro_batches - warmup, micro_batches):
        input_grad(mb)
    return order + [Op(WEIGHT_GRAD, mb) for mb in pending]


def _interleaved(ranks, micro_batches, rank, virtual_stages):
    total = micro_batches * virtual_stages

    def forward(k):
        return Op(FORWARD, (k // (ranks * virtual_stages)) * ranks + k % ranks, (k // ranks) % virtual_stages)

    def backward(k):
        return Op(BACKWARD, (k // (ranks * virtual_stages)) * ranks + k % ranks,
                  virtual_stages - 1 - (k // ranks) % virtual_stages)

    warmup = min((ranks - rank - 1) * 2 + (virtual_stages - 1) * ranks, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [forward(k), backward(k - warmup)]
    return order + [backward(k) for k in range(total - warmup, total)]


def _dualpipev(ranks, micro_batches, rank):
    """DualPipe's eight steps for the V shape (chunk 0 runs towards the last rank, chunk 1 back to rank 0), in
    DeepSpeed's order of forwards and backwards. Split backwards leave their W in a queue: step 3's W runs at
    once, while the next forward arrives; the second half of step 6's backwards and step 7's defer theirs into
    steps 7 and 8, where the rank would otherwise wait."""
    nxt = {(kind, chunk): 0 for kind in (FORWARD, BACKWARD) for chunk in (0, 1)}
    deferred: List[Op] = []
    order: List[Op] = []

    def f(chunk):
        order.append(Op(FORWARD, nxt[FORWARD, chunk], chunk))
        nxt[FORWARD, chunk] += 1

    def b(chunk, split=False):
        mb = nxt[BACKWARD, chunk]
        nxt[BACKWARD, chunk] += 1
        order.append(Op(INPUT_GRAD if split else BACKWARD, mb, chunk))
        if split:
            deferred.append(Op(WEIGHT_GRAD, mb, chunk))

    def w():
        if deferred:
            order.append(deferred.pop(0))

    for _ in range((ranks - rank - 1) * 2):                  # 1: forwards of chunk 0
        f(0)
    for _ in range(rank + 1):                                 # 2: chunk 0 and chunk 1 in turn
        f(0)
        f(1)
    for _ in range(ranks - rank - 1):                         # 3: chunk 1's backward, its W while the next
        b(1, split=True)                                      #    forward arrives, that forward
        w()
        f(1)
    for _ in range(micro_batches - 2 * ranks + rank + 1):    # 4: the main step, both chunks both ways
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(ranks - rank - 1):                         # 5
        b(1)
        f(1)
        b(0)
    for index in range(2 * (rank + 1)):                       # 6: both chunks' backwards, the second half
        b(1 if index % 2 == 0 else 0, split=index >= rank + 1)  # of them input gradients only
    for _ in range(ranks - rank - 1):                         # 7: a weight gradient, then an input gradient
        w()
        b(0, split=True)
    for _ in range(rank + 1):                                 # 8: the remaining weight gradients
        w()
    return order


# --- the simulation ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkTimes:
    """Seconds of one micro-batch through one chunk: forward, input gradient, weight gradient (a whole
    backward takes input + weight)."""
    forward: float
    input_grad: float
    weight_grad: float

    def of(self, kind: str) -> float:
        return {FORWARD: self.forward, INPUT_GRAD: self.input_grad, WEIGHT_GRAD: self.weight_grad,
                BACKWARD: self.input_grad + self.weight_grad}[kind]


def split_micro_batch(schedule: str, virtual_stages: int = 1, full_recompute: bool = False) -> ChunkTimes:
    """One micro-batch through one chunk, in units of a stage's forward: forward 1, input gradient 1 (2 with full
    recompute, which runs the forward again first), weight gradient 1 (a linear layer's two backward GEMMs each
    cost its forward's), each over the rank's chunks. The planner's and the timeline's assumption."""
    chunks = chunks_per_rank(schedule, virtual_stages)
    return ChunkTimes(1.0 / chunks, (2.0 if full_recompute else 1.0) / chunks, 1.0 / chunks)


@dataclass(frozen=True)
class Simulation:
    makespan: float                    # seconds from the first op to the last
    busy: Tuple[float, ...]            # per rank: seconds computing
    peak_in_flight: Tuple[int, ...]    # per rank: the most micro-batch chunks whose activations it holds at once

    @property
    def idle_share(self) -> Tuple[float, ...]:
        """Per rank: the share of the makespan it waits."""
        return tuple(1 - busy / self.makespan for busy in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The share of the makespan the busiest rank waits: what the schedule adds to its compute."""
        return 1 - max(self.busy) / self.makespan


class ScheduleDeadlock(RuntimeError):
    pass


def simulate(schedule: str, ranks: int, micro_batches: int, times: ChunkTimes, virtual_stages: int = 1,
             p2p_latency: float = 0.0, orders: Sequence[List[Op]] = None) -> Simulation:
    """Run every rank's order as a dataflow: an op starts once its rank has finished the op before it and its
    input is there (a forward: the previous model stage's forward of the micro-batch plus p2p_latency when that
    stage sits on another rank; a backward: the next stage's input gradient, and this stage's forward; a W: this
    stage's B). ScheduleDeadlock when an order waits for an op that can never run."""
    orders = orders or [stage_order(schedule, ranks, micro_batches, rank, virtual_stages) for rank in range(ranks)]
    last_stage = ranks * chunks_per_rank(schedule, virtual_stages) - 1
    where = {model_stage(schedule, ranks, rank, chunk): rank
             for rank in range(ranks) for chunk in range(chunks_per_rank(schedule, virtual_stages))}
    done: Dict[Tuple[str, int, int], float] = {}   # (F or B, micro-batch, model stage) -> finish time
    clock, position = [0.0] * ranks, [0] * ranks
    busy, in_flight, peak = [0.0] * ranks, [0] * ranks, [0] * ranks

    def ready_at(rank, op):
        stage = model_stage(schedule, ranks, rank, op.chunk)
        if op.kind == FORWARD:
            needs = [] if stage == 0 else [("F", op.micro_batch, stage - 1)]
        elif op.kind == WEIGHT_GRAD:
            needs = [("B", op.micro_batch, stage)]
        else:
            needs = [("F", op.micro_batch, stage)] + ([] if stage == last_stage else [("B", op.micro_batch, stage + 1)])
        if any(need not in done for need in needs):
            return None
        return max([clock[rank]] + [done[need] + (p2p_latency if where[need[2]] != rank else 0.0) for need in needs])

    remaining = sum(map(len, orders))
    while remaining:
        progressed = False
        for rank in range(ranks):
            while position[rank] < len(orders[rank]):
                op = orders[rank][position[rank]]
                start = ready_at(rank, op)
                if start is None:
                    break
                finish = start + times.of(op.kind)
                stage = model_stage(schedule, ranks, rank, op.chunk)
                if op.kind == FORWARD:
                    done["F", op.micro_batch, stage] = finish
                    in_flight[rank] += 1
                    peak[rank] = max(peak[rank], in_flight[rank])
                else:
                    if op.kind != WEIGHT_GRAD:
                        done["B", op.micro_batch, stage] = finish
                    if op.kind != INPUT_GRAD:  # the activations go once the weight gradient is taken
                        in_flight[rank] -= 1
                clock[rank], busy[rank] = finish, busy[rank] + times.of(op.kind)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {rank: orders[rank][position[rank]] for rank in range(ranks) if position[rank] < len(orders[rank])}
            raise ScheduleDeadlock(f"{schedule} at {ranks} ranks, {micro_batches} micro-batches: every rank waits "
                                   f"({', '.join(f'rank {r} at {op}' for r, op in stuck.items())})")
    return Simulation(max(clock), tuple(busy), tuple(peak))
