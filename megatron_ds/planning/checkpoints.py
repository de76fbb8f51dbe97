"""What a checkpoint costs and how often to write one.

A checkpoint holds every parameter's weights and optimizer states (planning/memory.checkpoint_bytes); written to a
file system with aggregate write bandwidth W it takes bytes / W (the run waits that long without --async-save;
with it, only for the copy to host memory). A failure loses the iterations since the last save, half an interval
on average, plus the restart. The interval that loses the least time in all, for a job whose mean time between
failures is M, is sqrt(2 x write time x M) (Young 1974, "A first order approximation to the optimum checkpoint
interval"; Daly 2006 refines it for long write times).
"""
import math
from typing import Optional

from megatron_ds.planning.memory import checkpoint_bytes
from megatron_ds.planning.model import Layout, ModelSpec


def checkpoint_section(model: ModelSpec, layout: Layout, iteration_s: float, write_gbs: float,
                       mtbf_hours: Optional[float]) -> dict:
    size = checkpoint_bytes(model, layout.zero_stage)
    write_s = size / (write_gbs * 1e9)
    section = {"bytes": size, "write_gbs": write_gbs, "write_s": write_s}
    if mtbf_hours:
        interval_s = math.sqrt(2 * write_s * mtbf_hours * 3600)
        iterations = max(1, round(interval_s / iteration_s))
        section |= {"mtbf_hours": mtbf_hours, "save_interval": iterations,
                    "lost_per_failure_s": iterations * iteration_s / 2,
                    "overhead_fraction": write_s / (iterations * iteration_s)}
    return section
