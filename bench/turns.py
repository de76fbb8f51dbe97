"""Turn taking: the measurement method of the benches that print a ratio. The sides compared (whole training
launches, or a loop in one process) start together and take turns step by step: in each rotation every side
still running takes one step, all of its processes at once, while the other sides wait. Each step has the whole
machine while it runs, and a slowdown of this shared host, which moves by 2x within minutes, falls on the steps
of every side alike instead of on whichever side ran during it.

Why turns rather than running the sides concurrently, each pinned to its own core: a pipeline or a TP 2 side
needs both cores of this host for one step, and the benches' third and fourth sides (the GEMM roof, the run
without dropout) would need cores of their own. Where both methods apply (two single-process sides) they were
measured against each other (bench/method_spread.py, the LLaMA row, 3 runs of each alternated, 2026-12-05): the
ranges of rounds within a run were 0.06, 0.01, 0.03 pinned and 0.03, 0.06, 0.09 in turns, so pinned repeats itself
somewhat better on a pair; its ratio is of one thread per side. `--method pinned` is that method: the sides step
at the same time, each process on a core of its own with one thread (its threads' affinity set at each step), the
cores swapped every rotation, each side's step timed from the common "go" to its own "done".

The coordinator (TurnTaking, in the bench's process) times each turn from its "go" to the last process's
"done"; ratios are taken between sides' steps of the same rotation, a round's ratio is the median of its
rotations' (a burst of load on one step moves a mean, not a median), and a figure prints only when the rounds
agree within the bench's stated spread (Ratio.text). A side's processes that finish hold their exit until every
side has finished, so no exit runs beside another side's step. Start-up is not gated: the first turn is given
once every process of every side has asked for one.

run_in_turns starts each side's command and runs the coordinator; alternate() is the same method for sides
that are functions in one process. `--method sequential` (every bench) is the method this replaced, kept for
contrast: each side takes all its steps before the next side takes any, so a side's i-th step and another's lie
minutes apart. A process of a side:
`turn = Turn.from_environment()`, then `with turn.taken(): step()` per step and
`turn.finish()` at the end. `python bench/turns.py <pretrain.py flags>` is pretrain.py with each iteration a turn
(the rank script of a launch; TurnTaking.environment(side) is the environment to launch it with).

Every side runs with glibc's malloc keeping the memory it frees (`--malloc keep`, the default: MALLOC_KEEP). With
glibc's defaults each block over its mmap threshold (at most 32 MB) is mapped afresh at every allocation and its pages
faulted in by the kernel: the GPT-2 row's loops took ~450,000 page faults per iteration, whose cost moved with the
state of the machine's memory over a run (the plain loop's iterations drifted from 2.9 s to 2.3 s within one run),
so that the rounds of a ratio spread by 10-20% however the sides took turns. Kept, a side faults in its memory in
its first iterations (the warm-up) and none after: the same row's rounds lay within 2-3.5% of their median in
each of four runs, on 2026-12-06.
"""
import contextlib
import ctypes
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ADDRESS, SIDE = "BENCH_TURNS_ADDRESS", "BENCH_TURNS_SIDE"
# rotations a bench leaves out: training launches here ran their first iterations up to 50% slower (one-off costs,
# torch.compile's worker processes starting beside them), settled by the sixth
WARM_UP = 6
METHODS = ("turns", "sequential", "pinned")
# glibc malloc's settings that keep freed memory for reuse: no block mapped afresh (M_MMAP_MAX 0), the heap's top
# handed back to the kernel only past 2 GiB free (M_TRIM_THRESHOLD; the largest value mallopt takes). Environment
# variable: (mallopt parameter, value)
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": (-4, 0), "MALLOC_TRIM_THRESHOLD_": (-1, 2**31 - 1)}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SideFailed(RuntimeError):
    """A side's process closed its connection (it died, or ended without finish())."""


class _Connection:
    """One process of a side, line by line over a local socket."""

    def __init__(self, sock):
        self.sock, self.buffer = sock, b""

    def send(self, word):
        self.sock.sendall(word.encode() + b"\n")

    def receive(self, alive):
        """The next line; alive() is called every second while waiting (raises if a launch died)."""
        while b"\n" not in self.buffer:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                alive()
                continue
            if not data:
                raise EOFError
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


class TurnTaking:
    """The coordinator. sides: {name: number of processes that take each of its turns}; sequential: each side
    takes all its turns before the next side takes any; pinned: every side steps at once, each on a core of its
    own (single-process sides, no more than the cores this process may run on)."""

    def __init__(self, sides, start_up_timeout=900, sequential=False, pinned=False):
        self.sides, self.start_up_timeout, self.sequential = dict(sides), start_up_timeout, sequential
        self.cores = sorted(os.sched_getaffinity(0)) if pinned else None
        if pinned and (max(self.sides.values()) > 1 or len(self.sides) > len(self.cores)):
            raise ValueError(f"--method pinned runs each side as one process on a core of its own: {self.sides} "
                             f"on {len(self.cores)} core(s)")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.turns = {name: [] for name in self.sides}  # seconds of each turn, in order

    def environment(self, side):
        host, port = self.listener.getsockname()
        return {ADDRESS: f"{host}:{port}", SIDE: side}

    def run(self, alive=lambda: None):
        """Give turns until every side has finished; returns {side: [seconds per turn]}."""
        connections = self._connect(alive)
        waiting = {name: [self._receive(name, connection, alive) for connection in members] for name, members in
                   connections.items()}  # every process's first request, before any turn is given
        running = list(self.sides)
        while running and self.cores:
            requests = {name: waiting.pop(name, None) or [self._receive(name, c, alive) for c in connections[name]]
                        for name in running}
            running = [name for name in running if requests[name] != ["finished"]]
            if running:
                self._together(running, {name: connections[name][0] for name in running}, alive)
        while running:
            for name in running[:1] if self.sequential else list(running):
                requests = waiting.pop(name, None) or [self._receive(name, c, alive) for c in connections[name]]
                if set(requests) == {"finished"}:
                    running.remove(name)
                elif set(requests) == {"ready"}:
                    self.turns[name].append(self._turn(name, connections[name], alive))
                else:
                    raise SideFailed(f"side {name}'s processes disagree about their next step: {requests}")
        for members in connections.values():
            for connection in members:
                connection.send("go")
        self.listener.close()
        return self.turns

    def _connect(self, alive):
        connections = {name: [] for name in self.sides}
        deadline = time.monotonic() + self.start_up_timeout
        self.listener.settimeout(1.0)
        while sum(map(len, connections.values())) < sum(self.sides.values()):
            if time.monotonic() > deadline:
                raise SideFailed(f"not every side's processes connected within {self.start_up_timeout} s: "
                                 f"{ {name: len(members) for name, members in connections.items()} } of {self.sides}")
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                alive()
                continue
            sock.settimeout(1.0)
            connection = _Connection(sock)
            name = connection.receive(alive)
            if name not in connections:
                raise SideFailed(f"a process connected as side {name!r}, which is not one of {list(self.sides)}")
            connections[name].append(connection)
        return connections

    def _receive(self, name, connection, alive):
        try:
            return connection.receive(alive)
        except (EOFError, OSError) as error:
            raise SideFailed(f"a process of side {name} closed its connection ({type(error).__name__})") from error

    def _together(self, names, connections, alive):
        """One pinned rotation: every side goes at once on its core (the assignment turned by one each rotation);
        each side's time runs to its own "done"."""
        rotation = len(self.turns[names[0]])
        start = time.perf_counter()
        for index, name in enumerate(names):
            connections[name].send(f"go {self.cores[(index + rotation) % len(self.cores)]}")
        pending = dict(connections)
        with selectors.DefaultSelector() as selector:
            for name, connection in pending.items():
                selector.register(connection.sock, selectors.EVENT_READ, name)
            while pending:
                events = selector.select(timeout=1.0)
                if not events:
                    alive()
                for key, _ in events:
                    reply = self._receive(key.data, pending.pop(key.data), alive)
                    if reply != "done":
                        raise SideFailed(f"side {key.data} answered its turn with {reply!r}")
                    self.turns[key.data].append(time.perf_counter() - start)
                    selector.unregister(key.fileobj)

    def _turn(self, name, members, alive):
        start = time.perf_counter()
        for connection in members:
            connection.send("go")
        replies = [self._receive(name, connection, alive) for connection in members]
        if set(replies) != {"done"}:
            raise SideFailed(f"side {name} answered its turn with {replies}")
        return time.perf_counter() - start


def run_in_turns(sides, folder, environment=None, sequential=False, pinned=False):
    """sides: {name: (command, number of processes)}. Starts every side's command (from the repository, with its
    turn's environment over `environment`, its output to a file in folder), gives turns until all have finished and
    returns ({name: [seconds per turn]}, {name: output}). A side that fails stops everything, with its output.
    sequential, pinned: TurnTaking's (pinned: one thread per process)."""
    turns = TurnTaking({name: processes for name, (_, processes) in sides.items()}, sequential=sequential,
                       pinned=pinned)
    files = {name: os.path.join(folder, f"side{index}.txt") for index, name in enumerate(sides)}
    environment = {**(environment or os.environ), **({"OMP_NUM_THREADS": "1"} if pinned else {})}
    launches = {name: _start(command, files[name], {**environment, **_threads(environment, processes),
                                                    **turns.environment(name)})
                for name, (command, processes) in sides.items()}

    def alive():
        for name, process in launches.items():
            if process.poll() is not None:
                raise SideFailed(f"{name} exited with status {process.returncode}:\n{_read(files[name])[-3000:]}")
    try:
        seconds = turns.run(alive)
        for process in launches.values():
            process.wait(timeout=300)
    finally:
        for process in launches.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    failed = [name for name, process in launches.items() if process.returncode != 0]
    if failed:
        raise SideFailed(f"{failed[0]} exited with status {launches[failed[0]].returncode}:\n"
                         f"{_read(files[failed[0]])[-3000:]}")
    return seconds, {name: _read(path) for name, path in files.items()}


def _threads(environment, processes):
    """A side has the machine during its turn: its processes share the cores (OMP_NUM_THREADS cores / processes)
    unless the environment sets a thread count. Two ranks of 2 threads each on 2 cores ran a TP 2 step 6x slower."""
    if environment.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // processes))}


def _start(command, path, environment):
    with open(path, "w") as output:
        return subprocess.Popen(command, cwd=REPO, env=environment, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _read(path):
    with open(path) as output:
        return output.read()


class Turn:
    """One process's end: its steps wait for their turn."""

    def __init__(self, address, side):
        host, port = address.rsplit(":", 1)
        self.connection = _Connection(socket.create_connection((host, int(port))))
        self.connection.send(side)

    @classmethod
    def from_environment(cls):
        """The turn of this process's side, or None when no bench coordinates it."""
        return cls(os.environ[ADDRESS], os.environ[SIDE]) if ADDRESS in os.environ else None

    @contextlib.contextmanager
    def taken(self):
        self._ask("ready")
        yield
        self.connection.send("done")

    def finish(self):
        """Ends this process's steps; returns once every side has finished."""
        self._ask("finished")

    def _ask(self, request):
        self.connection.send(request)
        reply = self.connection.receive(lambda: None)
        word, _, core = reply.partition(" ")
        if word != "go":
            raise RuntimeError(f"the turn coordinator answered {reply!r} to {request!r}")
        if core:
            _pin_threads(int(core))


def _pin_threads(core):
    """Every thread of this process onto one core (--method pinned)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended since the listing
            os.sched_setaffinity(int(thread), {core})


@dataclass
class Ratio:
    """A ratio of two sides' step times measured in turns: one figure per round (the median of its rotations')."""
    rounds: list
    rotations_per_round: int

    @classmethod
    def of(cls, numerator, denominator, rounds, warm_up):
        """numerator, denominator: seconds per turn of two sides (their i-th turns share a rotation); the first
        warm_up rotations are left out and the rest make `rounds` rounds."""
        pairs = list(zip(numerator, denominator))[warm_up:]
        size = len(pairs) // rounds
        if size < 1:
            raise ValueError(f"{len(pairs)} rotations after the {warm_up} warm-up ones cannot make {rounds} rounds")
        return cls([statistics.median(a / b for a, b in pairs[n * size:(n + 1) * size]) for n in range(rounds)],
                   size)

    @property
    def median(self):
        return statistics.median(self.rounds)

    @property
    def spread(self):
        """How far apart the rounds lie, as a fraction of their median (0.05: 5%)."""
        return (max(self.rounds) - min(self.rounds)) / self.median

    def text(self, max_spread, digits=2):
        """'1.02x (rounds 0.99-1.04, 5 rounds of 6)', or 'unstable: ...' with the rounds it would take when the
        rounds lie more than max_spread (a fraction of their median) apart."""
        span = f"{min(self.rounds):.{digits}f}-{max(self.rounds):.{digits}f}"
        if self.spread > max_spread:
            return (f"unstable: rounds {span} lie {100 * self.spread:.1f}% apart (> {100 * max_spread:g}%); about "
                    f"{self.rounds_needed(max_spread)} rounds needed")
        return (f"{self.median:.{digits}f}x (rounds {span}, "
                f"{rounds_of(len(self.rounds), self.rotations_per_round)})")

    def rounds_needed(self, max_spread):
        """Rounds for the median's standard error to fall under a quarter of max_spread (normal approximation)."""
        deviation = statistics.stdev(self.rounds) / self.median if len(self.rounds) > 1 else 0.0
        return max(len(self.rounds) + 1, int((4 * deviation / max_spread) ** 2) + 1)


def alternate(steps, rotations, synchronize=lambda: None, sequential=False, clock=time.perf_counter):
    """Turns within one process: steps is {name: function taking one step}; each rotation calls every function
    once, the order rotated by one from each rotation to the next (sequential: each function `rotations` times in
    a row, one after the other). Returns {name: [seconds (of clock) per call]}."""
    names, seconds = list(steps), {name: [] for name in steps}
    for name in _call_order(names, rotations, sequential):
        synchronize()
        start = clock()
        steps[name]()
        synchronize()
        seconds[name].append(clock() - start)
    return seconds


def _call_order(names, rotations, sequential):
    if sequential:
        return [name for name in names for _ in range(rotations)]
    return [name for rotation in range(rotations)
            for name in names[rotation % len(names):] + names[:rotation % len(names)]]


def add_arguments(parser, rotations_per_round):
    """The flags of every bench measured in turns: --rounds, --rotations-per-round, --max-spread."""
    parser.add_argument("--rounds", type=int, default=5, help="rounds a ratio is printed over (its spread)")
    parser.add_argument("--rotations-per-round", type=int, default=rotations_per_round,
                        help="rotations (one step of every side) per round; a round's ratio is their median")
    parser.add_argument("--max-spread", type=float, default=0.05,
                        help="a ratio whose rounds lie further apart than this fraction of their median (0.05: 5%%) "
                             "prints as unstable")
    parser.add_argument("--method", choices=METHODS, default="turns",
                        help="sequential: each side takes all its steps before the next (the former method, for "
                             "contrast); pinned: the sides step at the same time, each on a core of its own with one "
                             "thread (single-process sides, no more than the cores)")
    parser.add_argument("--malloc", choices=("keep", "system"), default="keep",
                        help="keep: every side's glibc malloc keeps the memory it frees for reuse (no block mapped "
                             "and faulted in afresh at each allocation); system: glibc's defaults")


def bench_environment(args, environment=None):
    """The environment of the sides of a bench (os.environ's by default) with --malloc keep's settings, where it
    does not set them itself."""
    environment = dict(os.environ if environment is None else environment)
    if args.malloc == "keep":
        environment = {**{name: str(value) for name, (_, value) in MALLOC_KEEP.items()}, **environment}
    return environment


def keep_freed_memory(args):
    """--malloc keep for a bench whose sides run in its own process: mallopt on this process (glibc only)."""
    if args.malloc != "keep":
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        raise SystemExit("--malloc keep needs glibc's mallopt, which this C library lacks: run with --malloc system")
    for name, (parameter, value) in MALLOC_KEEP.items():
        if name not in os.environ and mallopt(parameter, value) != 1:
            raise SystemExit(f"--malloc keep: mallopt({parameter}, {value}) ({name}) failed")


def sequential(args):
    """Whether the bench runs its sides one after the other (--method sequential)."""
    return args.method == "sequential"


def pinned(args):
    """Whether the bench runs its sides at the same time, a core each (--method pinned)."""
    return args.method == "pinned"


def method_words(args):
    """How the sides ran, for a bench's header."""
    method = {"sequential": "one after the other, each side all its steps (--method sequential)",
              "pinned": "at the same time, each on a core of its own with one thread, the cores swapped every "
                        "rotation (--method pinned)"}.get(args.method, "in turns, iteration by iteration")
    return method + (", glibc malloc keeping freed memory" if args.malloc == "keep" else ", glibc malloc's defaults")


def host_line(device=None):
    """The bench's host, for its header: the CPU's model and the extensions that decide a 16-bit matmul's speed on it
    (megatron_ds/launch/cpu_features.py; a bf16 figure from a CPU without avx512_bf16 / amx_bf16 is many times an fp32
    one's) and the cores this process may use; a GPU's name where the device (default: CUDA when available) is one."""
    import torch

    from megatron_ds.launch.cpu_features import host_description
    from megatron_ds.launch.runtime import available_cores
    cpu = f"CPU {host_description(available_cores())}"
    on_gpu = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    return f"host: GPU {torch.cuda.get_device_name()}; {cpu}" if on_gpu else f"host: {cpu}"


def total_rotations(args, warm_up=WARM_UP):
    """Steps each side takes: the warm-up, then --rounds x --rotations-per-round."""
    return warm_up + args.rounds * args.rotations_per_round


def rounds_of(rounds, rotations):
    return f"{rounds} round{'s' if rounds > 1 else ''} of {rotations}"


def pretrain_in_turns(argv):
    """pretrain.py, each training iteration (its global batch and optimizer step) one turn of this side."""
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()
    import torch

    import megatron_ds.training as training
    from megatron_ds.training import loop
    turn = Turn.from_environment()
    train_global_batch = loop._train_global_batch

    def in_turn(*args, **kwargs):
        with turn.taken():
            result = train_global_batch(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the iteration's kernels run in its own turn
            return result

    loop._train_global_batch = in_turn
    status = training.pretrain(argv)
    turn.finish()
    return status


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(pretrain_in_turns(sys.argv[1:]))
