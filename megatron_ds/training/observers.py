"""What watches the training iterations without changing them, as one list the loop calls: the pipeline timeline
(--pipeline-timeline), the profiler (--profile), torch.compile's cost, the reproducibility report (--rerun-mode
report_stats) and the straggler detector (--log-straggler).

The loop calls begin before an iteration's global batch and end after it; logged after the iteration's log
line; finish once the loop is over. begin and finish go down the list, end and logged up it, so each observer's
window nests inside the ones begun before it.
"""
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.transformer.fused_ops import compiled_ops
from megatron_ds.launch.runtime import print_rank_0
from megatron_ds.observability.compile_watch import CompileWatch
from megatron_ds.observability.metrics import is_logging_rank
from megatron_ds.observability.pipeline_timeline import pipeline_timeline
from megatron_ds.observability.profiling import IterationProfiler
from megatron_ds.training.resilience.rerun import ReproducibilityStats, ResultValidator, Validation
from megatron_ds.training.resilience.stragglers import StragglerDetector


class IterationObserver:
    """One watcher of the iterations; a hook it does not override does nothing."""

    def begin(self, iteration, plan):
        pass

    def end(self, iteration):
        pass

    def logged(self, iteration, at_log_interval, writers):
        pass

    def finish(self, iteration, stopped_early):
        pass


class IterationObservers:
    def __init__(self, observers):
        self.observers = list(observers)

    def begin(self, iteration, plan):
        for observer in self.observers:
            observer.begin(iteration, plan)

    def end(self, iteration):
        for observer in reversed(self.observers):
            observer.end(iteration)

    def logged(self, iteration, at_log_interval, writers):
        for observer in reversed(self.observers):
            observer.logged(iteration, at_log_interval, writers)

    def finish(self, iteration, stopped_early=False):
        for observer in self.observers:
            observer.finish(iteration, stopped_early)


def iteration_observers(logging, parallel, model, engine, first_iteration, validator):
    """The run's observers, from its LoggingConfig, ParallelLayout and TransformerConfig; validator: the
    --rerun-mode validator (result_validator), whose statistics are reported at the log interval."""
    observers = [_Timeline(pipeline_timeline(logging, parallel, model, engine, first_iteration)),
                 _Profiler(IterationProfiler(logging, dist.get_rank())),
                 _CompileCost(CompileWatch(bool(compiled_ops(model))))]
    if isinstance(validator, ReproducibilityStats):
        observers.append(_Reproducibility(validator, logging.log_interval))
    if logging.log_straggler:
        observers.append(_Stragglers(_straggler_detector(logging)))
    return IterationObservers(observers)


def result_validator(rerun, engine):
    """--rerun-mode's validator (megatron_ds/training/resilience/rerun.py) from the run's RerunConfig, or None
    when disabled."""
    if rerun.rerun_mode == "validate_results":
        return ResultValidator(Validation.from_config(rerun), engine)
    if rerun.rerun_mode == "report_stats":
        return ReproducibilityStats(Validation.from_config(rerun), engine, rerun.rerun_stats_interval)
    return None


class _Timeline(IterationObserver):
    def __init__(self, timeline):
        self.timeline = timeline

    def begin(self, iteration, plan):
        self.timeline.begin(iteration, plan.micro_batches)

    def end(self, iteration):
        self.timeline.end()

    def finish(self, iteration, stopped_early):
        self.timeline.finish()


class _Profiler(IterationObserver):
    def __init__(self, profiler):
        self.profiler = profiler

    def begin(self, iteration, plan):
        self.profiler.begin(iteration)

    def end(self, iteration):
        self.profiler.end(iteration)


class _CompileCost(IterationObserver):
    """The graphs torch.compile built in an iteration, said after its log line; the total at the end."""

    def __init__(self, watch):
        self.watch, self.line = watch, None

    def begin(self, iteration, plan):
        self.watch.before_iteration()

    def end(self, iteration):
        self.line = self.watch.after_iteration(iteration)

    def logged(self, iteration, at_log_interval, writers):
        _print_line(self.line)

    def finish(self, iteration, stopped_early):
        if not stopped_early:
            _print_line(self.watch.summary())


class _Reproducibility(IterationObserver):
    def __init__(self, stats, log_interval):
        self.stats, self.log_interval = stats, log_interval

    def logged(self, iteration, at_log_interval, writers):
        if at_log_interval:
            print_rank_0(self.stats.report(iteration))

    def finish(self, iteration, stopped_early):
        if not stopped_early and iteration % self.log_interval:
            print_rank_0(self.stats.report(iteration))


class _Stragglers(IterationObserver):
    def __init__(self, detector):
        self.detector = detector

    def begin(self, iteration, plan):
        self.detector.begin()

    def end(self, iteration):
        self.detector.end()

    def logged(self, iteration, at_log_interval, writers):
        if at_log_interval:
            self.detector.report(iteration, is_logging_rank(), writers)


def _straggler_detector(config):
    """--log-straggler's detector (megatron_ds/training/resilience/stragglers.py)."""
    return StragglerDetector(config.straggler_threshold, config.straggler_minmax_count, config.straggler_intervals,
                             parallel_state.get_pipeline_model_parallel_rank(),
                             enabled=not config.disable_straggler_on_startup, switch_port=config.straggler_ctrlr_port)


def _print_line(line):
    if line:
        print_rank_0(line)
