"""--profile: record iterations --profile-step-start .. --profile-step-end - 1 on the ranks in --profile-ranks.

With --use-pytorch-profiler, torch.profiler records CPU operators (and CUDA kernels on GPUs). Each
profiled rank writes a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev):

    <--profile-dir, else --tensorboard-dir, else .>/profile_rank<R>_iterations<START>-<END - 1>.json

and prints the operators that took the most time, as torch.profiler's table. Without
--use-pytorch-profiler the window is handed to CUDA's profiler API (cudaProfilerStart/Stop), for
`nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`, as in Megatron-LM.
"""
import os

import torch

TABLE_ROWS = 25


def window_errors(named, end_named, start, end, train_iters):
    """Problems with a window of iterations start .. end - 1 (named: its flags and values; end_named: its end's)."""
    if not 1 <= start < end:
        return [f"{named}: need 1 <= start < end (iterations start .. end - 1 are recorded)"]
    if train_iters is not None and end > train_iters + 1:
        return [f"{end_named} is past --train-iters {train_iters}: the window would never close (use at most "
                f"{train_iters + 1})"]
    return []


def profile_errors(args):
    """Problems with the --profile flags, found before any process group exists."""
    if not args.profile:
        return []
    start, end = args.profile_step_start, args.profile_step_end
    errors = window_errors(f"--profile-step-start {start} and --profile-step-end {end}", f"--profile-step-end {end}",
                           start, end, args.train_iters)
    outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
    if outside:
        errors.append(f"--profile-ranks {outside} outside the world of {args.world_size} ranks")
    if not args.use_pytorch_profiler and not torch.cuda.is_available():
        errors.append("--profile without --use-pytorch-profiler drives CUDA's profiler API (for nsys), which "
                      "needs a GPU; add --use-pytorch-profiler")
    return errors


class IterationProfiler:
    """Call begin(iteration) before and end(iteration) after each training iteration."""

    def __init__(self, logging, rank):
        """logging: the run's LoggingConfig (the profiler's flags and --tensorboard-dir)."""
        self.active = bool(logging.profile) and rank in logging.profile_ranks
        self.rank = rank
        self.start, self.stop = logging.profile_step_start, logging.profile_step_end
        self.use_torch, self.with_stack = logging.use_pytorch_profiler, logging.profile_with_stack
        self.folder = logging.profile_dir or logging.tensorboard_dir or "."
        self.recording, self.recorder = False, None

    def begin(self, iteration):
        if not (self.active and iteration == self.start):
            return  # a run resumed past the start records nothing
        self.recording = True
        if self.use_torch:
            self.recorder = torch.profiler.profile(activities=_activities(), with_stack=self.with_stack)
            self.recorder.__enter__()
        else:
            torch.cuda.cudart().cudaProfilerStart()

    def end(self, iteration):
        if not (self.recording and iteration == self.stop - 1):
            return
        self.recording = False
        if self.use_torch:
            self.recorder.__exit__(None, None, None)
            self._report(self.recorder)
            self.recorder = None
        else:
            torch.cuda.cudart().cudaProfilerStop()

    def _report(self, recorder):
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"profile_rank{self.rank}_iterations{self.start}-{self.stop - 1}.json")
        partial = f"{path}.tmp"
        recorder.export_chrome_trace(partial)
        os.replace(partial, path)
        table = recorder.key_averages().table(sort_by=table_sort_key(torch.cuda.is_available()), row_limit=TABLE_ROWS)
        print(f"megatron_ds [rank {self.rank}]: profile of iterations {self.start}-{self.stop - 1} "
              f"(trace: {path}):\n{table}", flush=True)


def table_sort_key(cuda):
    """The column the table is sorted by: the operators' own time on the GPU on GPUs (torch 2.4 renamed the
    self_cuda_time_total of the events to self_device_time_total), else their own CPU time."""
    return "self_device_time_total" if cuda else "self_cpu_time_total"


def _activities():
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
