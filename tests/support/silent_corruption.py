"""pretrain.py with one rank's model output made NaN once, in the first computation of an iteration: a silent
data corruption of that rank's device that a replay does not repeat (the corrupted value flows on to the other
stages and into the loss, as a real one would); with ":persistent", in every computation of that iteration on
that rank, whatever micro-batches it computes (a persistent fault of its device); with ":backward", the gradient
of the rank's first parameter made NaN once instead (a fault in the backward pass: the loss does not show it):

    torchrun --nproc_per_node 4 -m tests.support.silent_corruption RANK@ITERATION[:persistent|:backward]
        <pretrain.py flags>
"""
import sys

import torch.distributed as dist


def install_corruption(rank, iteration, kind=""):
    from megatron_ds.training import initialize, loop
    setup_engine, begin_iteration = initialize.setup_engine, loop.begin_iteration
    state = {"iteration": None, "done": False}

    def corrupt(module, inputs, output):
        if state["iteration"] != iteration or state["done"]:
            return None
        state["done"] = kind != "persistent"
        first = output[0] if isinstance(output, (tuple, list)) else output
        first = first * float("nan")
        return (first, *output[1:]) if isinstance(output, (tuple, list)) else first

    def corrupt_gradient(gradient):
        return corrupt(None, None, gradient)

    def setup_and_corrupt(*args, **kwargs):
        engine = setup_engine(*args, **kwargs)
        if dist.get_rank() == rank and kind == "backward":
            next(param for param in engine.module.parameters() if param.requires_grad).register_hook(corrupt_gradient)
        elif dist.get_rank() == rank:
            engine.module.register_forward_hook(corrupt)
        return engine

    def note_iteration(parallel, engine, plan):
        state["iteration"] = plan.iteration
        return begin_iteration(parallel, engine, plan)

    initialize.setup_engine, loop.begin_iteration = setup_and_corrupt, note_iteration


if __name__ == "__main__":
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py
    rank, _, at = sys.argv[1].partition("@")
    at, _, kind = at.partition(":")
    install_corruption(int(rank), int(at), kind)
    from megatron_ds.training import pretrain
    sys.exit(pretrain(sys.argv[2:]))
