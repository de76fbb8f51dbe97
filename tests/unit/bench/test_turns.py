"""bench/turns.py, the benches' measurement method, with real processes on a local socket: sides take turns step
by step (no two sides' steps overlap, every process of a side steps in the same turn), a side that finishes early
holds its exit until the last side's last step, a side whose process dies is named; the in-process alternation;
the round ratios and their "unstable" verdict; --malloc keep's effect on page faults."""
import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from bench.turns import Ratio, SideFailed, TurnTaking, alternate, bench_environment, run_in_turns
from tests.support.launch import REPO

SIDE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from bench.turns import Turn
    turn = Turn.from_environment()
    with open(sys.argv[2], "w") as log:
        for step in range(int(sys.argv[1])):
            with turn.taken():
                start = time.monotonic()
                time.sleep(0.005)
                log.write(f"{start} {time.monotonic()}\\n")
        turn.finish()
        log.write(f"exit {time.monotonic()}\\n")
""")


def _start(turns, side, steps, log):
    return subprocess.Popen([sys.executable, "-c", SIDE, str(steps), str(log), str(REPO)],
                            env={**os.environ, **turns.environment(side)})


def _steps(log):
    lines = log.read_text().splitlines()
    return [tuple(map(float, line.split())) for line in lines[:-1]], float(lines[-1].split()[1])


def test_sides_step_in_turns_and_the_early_finisher_waits_for_the_last(tmp_path):
    turns = TurnTaking({"a": 1, "b": 2})
    processes = {("a", 0): _start(turns, "a", 3, tmp_path / "a0"),
                 ("b", 0): _start(turns, "b", 6, tmp_path / "b0"), ("b", 1): _start(turns, "b", 6, tmp_path / "b1")}
    seconds = turns.run()
    assert all(process.wait(timeout=60) == 0 for process in processes.values())
    assert [len(seconds["a"]), len(seconds["b"])] == [3, 6]
    logs = {key: _steps(tmp_path / f"{key[0]}{key[1]}") for key in processes}
    a_steps, a_exit = logs["a", 0]
    b_steps = [logs["b", 0][0], logs["b", 1][0]]
    for start, end in a_steps:  # no step of b overlaps a step of a
        assert all(b_end <= start or b_start >= end for steps in b_steps for b_start, b_end in steps)
    for (start0, end0), (start1, end1) in zip(*b_steps):  # both processes of b step in the same turn
        assert start0 < end1 and start1 < end0
    assert a_exit >= max(end for steps in b_steps for _, end in steps)
    assert all(turn >= 0.005 for turn in seconds["a"] + seconds["b"])


def test_the_sequential_method_runs_every_step_of_one_side_before_the_next_side_s(tmp_path):
    turns = TurnTaking({"a": 1, "b": 1}, sequential=True)
    processes = [_start(turns, "a", 3, tmp_path / "a"), _start(turns, "b", 3, tmp_path / "b")]
    seconds = turns.run()
    assert all(process.wait(timeout=60) == 0 for process in processes) and len(seconds["b"]) == 3
    (a_steps, a_exit), (b_steps, _) = _steps(tmp_path / "a"), _steps(tmp_path / "b")
    assert max(end for _, end in a_steps) <= min(start for start, _ in b_steps)
    assert a_exit >= max(end for _, end in b_steps)  # the first side still holds its exit


def test_the_pinned_method_steps_the_sides_together_each_on_its_own_core_swapped_every_rotation(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs two cores")
    turns = TurnTaking({"a": 1, "b": 1}, pinned=True)
    turns.cores = cores
    side = SIDE.replace('log.write(f"{start} {time.monotonic()}\\n")',
                        'log.write(f"{start} {time.monotonic()} {sorted(os.sched_getaffinity(0))[0]}\\n")')
    side = side.replace("import sys, time", "import os, sys, time")
    processes = {name: subprocess.Popen([sys.executable, "-c", side, "4", str(tmp_path / name), str(REPO)],
                                        env={**os.environ, **turns.environment(name)}) for name in "ab"}
    seconds = turns.run()
    assert all(process.wait(timeout=60) == 0 for process in processes.values())
    logs = {name: [line.split() for line in (tmp_path / name).read_text().splitlines()[:-1]] for name in "ab"}
    for (a_start, a_end, a_core), (b_start, b_end, b_core) in zip(logs["a"], logs["b"]):
        assert float(a_start) < float(b_end) and float(b_start) < float(a_end)  # the steps overlap
        assert a_core != b_core
    assert [int(core) for _, _, core in logs["a"]] == [cores[0], cores[1]] * 2
    assert [len(seconds["a"]), len(seconds["b"])] == [4, 4] and min(seconds["a"] + seconds["b"]) >= 0.005


def test_the_pinned_method_refuses_more_sides_than_cores_or_a_side_of_two_processes():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="--method pinned runs each side as one process on a core of its own"):
        TurnTaking({f"side{n}": 1 for n in range(cores + 1)}, pinned=True)
    with pytest.raises(ValueError, match=r"\{'a': 2\}"):
        TurnTaking({"a": 2}, pinned=True)


def test_a_side_whose_process_dies_is_named(tmp_path):
    turns = TurnTaking({"steady": 1, "dying": 1})
    steady = _start(turns, "steady", 4, tmp_path / "steady")
    dies_in_its_turn = ("import os, socket; host, port = os.environ['BENCH_TURNS_ADDRESS'].split(':'); "
                        "s = socket.create_connection((host, int(port))); s.sendall(b'dying\\nready\\n'); s.recv(10); "
                        "os._exit(3)")
    dying = subprocess.Popen([sys.executable, "-c", dies_in_its_turn], env={**os.environ, **turns.environment("dying")})
    with pytest.raises(SideFailed, match="a process of side dying closed its connection"):
        turns.run()
    assert dying.wait(timeout=60) == 3
    steady.kill()


def test_round_ratios_are_medians_of_their_rotations_and_a_wide_spread_is_unstable():
    numerator = [9.0, 9.0] + [1.1, 1.1, 5.0] + [1.2, 0.1, 1.2]
    ratio = Ratio.of(numerator, [1.0] * 8, rounds=2, warm_up=2)
    assert ratio.rounds == [1.1, 1.2] and ratio.rotations_per_round == 3
    assert ratio.text(max_spread=0.15) == "1.15x (rounds 1.10-1.20, 2 rounds of 3)"
    assert ratio.spread == pytest.approx(0.1 / 1.15)
    assert ratio.text(max_spread=0.05).startswith("unstable: rounds 1.10-1.20 lie 8.7% apart (> 5%); about ")
    far_from_one = Ratio.of([2.1, 2.16], [1.0, 1.0], rounds=2, warm_up=0)  # 2.8% apart, 0.06 in ratio units
    assert far_from_one.text(max_spread=0.05) == "2.13x (rounds 2.10-2.16, 2 rounds of 1)"
    with pytest.raises(ValueError, match="1 rotations after the 2 warm-up ones cannot make 2 rounds"):
        Ratio.of([1.0] * 3, [1.0] * 3, rounds=2, warm_up=2)


def test_alternate_calls_every_step_once_per_rotation_in_a_rotated_order():
    calls = []
    seconds = alternate({name: (lambda name=name: calls.append(name)) for name in "abc"}, rotations=4)
    assert calls == list("abc" "bca" "cab" "abc")
    assert [len(seconds[name]) for name in "abc"] == [4, 4, 4]
    calls.clear()
    alternate({name: (lambda name=name: calls.append(name)) for name in "ab"}, rotations=3, sequential=True)
    assert calls == list("aaabbb")


def test_a_sides_processes_share_the_cores_unless_the_environment_sets_the_threads(tmp_path):
    script = tmp_path / "report.py"
    script.write_text("import os, sys; sys.path.insert(0, sys.argv[1]); from bench.turns import Turn; "
                      "turn = Turn.from_environment(); os.write(1, (os.environ['OMP_NUM_THREADS'] + '\\n').encode()); "
                      "turn.finish()")  # one write: two processes share the output file, maybe unbuffered
    one = f"'{sys.executable}' {script} {REPO}"
    sides = {"one": (["bash", "-c", one], 1), "two": (["bash", "-c", f"{one} & {one}; wait"], 2)}
    cores = len(os.sched_getaffinity(0))
    unset = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    _, outputs = run_in_turns(sides, tmp_path, unset)
    assert outputs["one"].split() == [str(cores)] and outputs["two"].split() == [str(max(1, cores // 2))] * 2
    _, outputs = run_in_turns(sides, tmp_path, {**unset, "OMP_NUM_THREADS": "3"})
    assert outputs["two"].split() == ["3", "3"]


FAULTS = textwrap.dedent("""
    import argparse, contextlib, resource, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from bench.turns import Turn, keep_freed_memory
    turn = Turn.from_environment()
    if turn is None:  # a bench's own process: sys.argv[2] is its --malloc
        keep_freed_memory(argparse.Namespace(malloc=sys.argv[2]))
    faults = []
    for step in range(6):
        with turn.taken() if turn else contextlib.nullcontext():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(4):
                block = torch.ones(16 << 20)  # 64 MB, over glibc's largest mmap threshold
                del block
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    if turn:
        turn.finish()
    print(*faults)
""")
PAGES_PER_STEP = 4 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")  # of the blocks FAULTS allocates in one step


def _without_malloc_settings():
    return {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_with_malloc_keep_a_side_faults_its_memory_in_once_and_with_system_at_every_allocation(tmp_path):
    sides = {"side": ([sys.executable, "-c", FAULTS, str(REPO)], 1)}
    faults = {}
    for malloc in ("keep", "system"):
        environment = bench_environment(argparse.Namespace(malloc=malloc), _without_malloc_settings())
        _, outputs = run_in_turns(sides, tmp_path, environment)
        faults[malloc] = [int(count) for count in outputs["side"].split()]
    pages = PAGES_PER_STEP
    # kept: glibc's heap grows over the first steps' allocations (faulted in), then serves them all
    assert faults["keep"][0] >= pages // 8 and max(faults["keep"][3:]) < pages // 100, faults
    assert min(faults["system"]) >= pages // 2, faults


def test_the_sides_environment_keeps_what_the_user_set():
    keep = argparse.Namespace(malloc="keep")
    assert bench_environment(keep, {"PATH": "/bin"}) == {"PATH": "/bin", "MALLOC_MMAP_MAX_": "0",
                                                         "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
    assert bench_environment(keep, {"MALLOC_MMAP_MAX_": "65536"})["MALLOC_MMAP_MAX_"] == "65536"
    assert bench_environment(argparse.Namespace(malloc="system"), {"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_sets_malloc_keep_in_a_bench_s_own_process():
    faults = {malloc: [int(count) for count in subprocess.run(
        [sys.executable, "-c", FAULTS, str(REPO), malloc], env=_without_malloc_settings(), capture_output=True,
        text=True, check=True).stdout.split()] for malloc in ("keep", "system")}
    pages = PAGES_PER_STEP
    assert max(faults["keep"][3:]) < pages // 100 and min(faults["system"]) >= pages // 2, faults
