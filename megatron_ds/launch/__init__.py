"""The process and the machine it runs on: what the launcher says, start-up, the devices, hang safety, storage.

    launcher_env.py   what the launcher that started this process says (rank, sizes, restarts)
    runtime.py        process start-up: CPU or GPU, threads per rank, the distributed backend, each rank's GPU
    devices.py        the one table of device facts (peak FLOP/s, memory, bandwidths)
    cpu_features.py   this CPU's model and 16-bit matrix extensions; the start-up warning where a run lacks them
    watchdog.py       hang safety: a rank that raises, dies or hangs makes every rank exit in bounded time
    storage.py        start-up checks of the folders a run writes
    topology.py       where the parallel groups land on the hardware (--print-topology)
"""
