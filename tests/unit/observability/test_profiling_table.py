"""--profile's table is sorted by the operators' own GPU time on GPUs: the key is one torch's EventList.table
takes (2.11 and 2.13 alike). On CPU, torch's own table code runs on a real CPU profile and on events carrying
kernel times, as the legacy profiler records them (the kineto profiler needs a GPU to record any)."""
import warnings

import torch
from torch.autograd.profiler_util import EventList, FunctionEvent

from megatron_ds.observability.profiling import table_sort_key

# (operator, its own CPU time, its kernel's GPU time) in microseconds: the CPU order is the GPU order reversed
OPERATORS = [("aten::small", 300, 5), ("aten::large", 10, 900), ("aten::middle", 100, 50)]


def _rows(table):
    return [line.split()[0] for line in table.splitlines() if line.strip().startswith("aten::")]


def _events_with_kernel_times():
    events = []
    for number, (name, cpu_us, gpu_us) in enumerate(OPERATORS):
        event = FunctionEvent(id=number, name=name, thread=0, start_us=1000 * number, end_us=1000 * number + cpu_us,
                              use_device="cuda", is_legacy=True)
        event.append_kernel(f"{name}_kernel", 0, gpu_us)
        events.append(event)
    return EventList(events, use_device="cuda")


def test_the_gpu_key_sorts_the_table_by_gpu_time_without_a_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = _events_with_kernel_times().table(sort_by=table_sort_key(cuda=True))
    assert _rows(table) == ["aten::large", "aten::middle", "aten::small"]
    assert "Self CUDA" in table


def test_the_cpu_key_sorts_the_same_events_by_cpu_time():
    table = _events_with_kernel_times().table(sort_by=table_sort_key(cuda=False))
    assert _rows(table) == ["aten::small", "aten::middle", "aten::large"]


def test_the_gpu_key_is_taken_for_a_real_cpu_profile():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.randn(32, 32) @ torch.randn(32, 32)
    table = profile.key_averages().table(sort_by=table_sort_key(cuda=True), row_limit=5)
    assert "aten::mm" in table or "aten::matmul" in table
