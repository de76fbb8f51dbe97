"""What a run reports about itself: the log, the throughput, the profile, the pipeline timeline, compile costs.

    metrics.py            Megatron's iteration and validation lines, timers, TensorBoard / W&B, memory lines
    throughput.py         peak FLOP/s per device for MFU: the device table, or a GEMM rate measured here
    profiling.py          --profile: torch.profiler over a window of iterations on chosen ranks
    pipeline_timeline.py  --pipeline-timeline: what each pipeline rank ran and when; the bubble measured
    compile_watch.py      what torch.compile costs a run: the graphs built in the first iterations
"""
