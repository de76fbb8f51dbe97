"""3D-parallel planning (tools/plan.py): exact parameter counts, memory per device, FLOPs, communication
volume and an estimated iteration time for a model on a cluster, with a search over layouts.

    devices.py        the one table of device facts (peak FLOP/s, memory, bandwidths)
    model.py          ModelSpec (the model), Layout (tp, Ulysses, pp, dp, batch, SP, recompute), Cluster
    parameters.py     exact parameter counts per stage and device; MoE: total and active, E/EP experts per rank
    memory.py         weights, gradients, ZeRO-1 optimizer shard (over Ulysses x DP; experts' over TP x DP / EP),
                      activations per 1F1B stage (/ Ulysses)
    flops.py          model and hardware FLOPs per iteration
    communication.py  bytes per axis (TP collectives, Ulysses and MoE all-to-alls, PP sends, DP reduction) and
                      their links
    performance.py    the time model and its assumptions
    planner.py        one layout -> a JSON-ready plan
    search.py         every layout, ranked (Ulysses where a layout needs it)
    meta.py           stages built on the meta device with the real model code, checked against the formulas
    cli.py            tools/plan.py's flags and output; the prediction pretrain.py prints beside its measured memory
    collective_devices.py  collectives on CPU tensors, which NCCL refuses, recorded from a CPU run
"""
