"""What torch.compile costs a run: the graphs the compiled fused ops build during the process's first two
training iterations (reported once then), and any graph a later training iteration builds, a recompilation
(counted, reported as it happens and at the end). Graphs built while evaluating (no-grad graphs, built at
the first evaluation) count in the totals, not as recompilations."""
from megatron_ds.core.fusions.backends import compile_statistics

WARM_ITERATIONS = 2


class CompileWatch:
    def __init__(self, active):
        self.active = active
        self.iterations = 0
        self.recompilations = 0
        self._graphs_before = 0

    def before_iteration(self):
        if self.active:
            self._graphs_before = compile_statistics()[0]

    def after_iteration(self, iteration):
        """A line to log after this training iteration, or None."""
        if not self.active:
            return None
        self.iterations += 1
        graphs, seconds = compile_statistics()
        if self.iterations == WARM_ITERATIONS:
            return (f"torch.compile built {graphs} graphs in {seconds:.1f} s during this run's first "
                    f"{WARM_ITERATIONS} iterations (the fused ops compile on first use)")
        new = graphs - self._graphs_before
        if self.iterations > WARM_ITERATIONS and new:
            self.recompilations += new
            return (f"WARNING: torch.compile recompiled at iteration {iteration} ({new} graphs; "
                    f"{self.recompilations} after this run's first {WARM_ITERATIONS} iterations)")
        return None

    def summary(self):
        """The closing line, or None."""
        if not self.active:
            return None
        graphs, seconds = compile_statistics()
        return (f"torch.compile: {graphs} graphs built in {seconds:.1f} s in all; {self.recompilations} "
                f"recompilations after this run's first {WARM_ITERATIONS} iterations")
