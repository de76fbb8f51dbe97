"""CompileWatch with real torch.compile graphs: the cost of the first two iterations is reported once, a graph
built by a later iteration is a recompilation (reported, counted), and an inactive watch says nothing."""
import torch

from megatron_ds.observability.compile_watch import CompileWatch


def _iteration(watch, iteration, work):
    watch.before_iteration()
    work()
    return watch.after_iteration(iteration)


def test_the_first_two_iterations_are_reported_and_later_graphs_are_recompilations():
    scaled = torch.compile(lambda x: x * 3 - 1, dynamic=False)  # static shapes: a new size is a new graph
    watch = CompileWatch(active=True)
    assert _iteration(watch, 5, lambda: scaled(torch.ones(4))) is None
    second = _iteration(watch, 6, lambda: scaled(torch.ones(4)))
    assert second.startswith("torch.compile built ") and "graphs in" in second and "first 2 iterations" in second
    assert _iteration(watch, 7, lambda: scaled(torch.ones(4))) is None
    recompiled = _iteration(watch, 8, lambda: scaled(torch.ones(7)))
    assert recompiled.startswith("WARNING: torch.compile recompiled at iteration 8 (1 graphs; 1 after")
    assert watch.summary().endswith("; 1 recompilations after this run's first 2 iterations")


def test_an_inactive_watch_reports_nothing():
    watch = CompileWatch(active=False)
    assert _iteration(watch, 1, lambda: None) is None and _iteration(watch, 2, lambda: None) is None
    assert watch.summary() is None
