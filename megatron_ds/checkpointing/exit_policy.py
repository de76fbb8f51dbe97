"""When training stops early: on a SIGTERM (--exit-signal-handler), past --exit-duration-in-mins, or at
--exit-interval. Ranks agree once per iteration (one MAX all-reduce each), so all stop after the same one;
the checkpoint manager saves before the stop."""
import signal
import time

import torch
import torch.distributed as dist

from megatron_ds.launch.runtime import device


def on_any_rank(condition):
    """True on every rank when condition holds on any (one MAX all-reduce)."""
    flag = torch.tensor([1 if condition else 0], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class ExitSignalHandler:
    """Remembers a SIGTERM (what schedulers send before killing a job); ranks agree on it once per iteration."""

    def __init__(self, signum=signal.SIGTERM):
        self.received = False
        signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank_received(self):
        return on_any_rank(self.received)


class ExitDuration:
    """--exit-duration-in-mins: minutes since the earliest rank started (Megatron's start of training);
    ranks agree once per iteration, so all stop after the same one."""

    def __init__(self, minutes, start_time):
        start = torch.tensor([start_time], dtype=torch.float64, device=device())
        dist.all_reduce(start, op=dist.ReduceOp.MIN)
        self.minutes, self.start = minutes, start.item()

    def elapsed_minutes(self):
        return (time.time() - self.start) / 60

    def reached(self):
        return on_any_rank(self.elapsed_minutes() > self.minutes)


class ExitPolicy:
    """config: the run's CheckpointingConfig (its exit flags); start_time: time.time() when the job started."""

    def __init__(self, config, start_time=None):
        self.config = config
        self.signal_handler = ExitSignalHandler() if config.exit_signal_handler else None
        self.duration = (ExitDuration(config.exit_duration_in_mins, time.time() if start_time is None
                                      else start_time) if config.exit_duration_in_mins else None)

    def reason_to_stop(self, iteration, saved):
        """Why training stops after `iteration` (every rank the same), or None. saved: what the message says of
        the checkpoint written before the stop."""
        if self.signal_handler is not None and self.signal_handler.any_rank_received():
            return f"exiting at iteration {iteration}: a rank received SIGTERM ({saved})"
        if self.duration is not None and self.duration.reached():
            return (f"exiting at iteration {iteration}: training has run {self.duration.elapsed_minutes():.1f} minutes "
                    f"(--exit-duration-in-mins {self.config.exit_duration_in_mins}; {saved})")
        interval = self.config.exit_interval
        if interval and iteration % interval == 0:
            return f"exiting at iteration {iteration} (--exit-interval {interval})"
        return None
