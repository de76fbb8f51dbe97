"""pretrain.py with rank 0 printing, after every optimizer step, how many (token, expert) rows the experts of each
dropless MoE layer of its stage computed over the global batch, summed over the stage's ranks (TP and
sequence-data-parallel: every rank computes the rows of its own experts):

    torchrun --nproc_per_node 2 -m tests.support.expert_choices <pretrain.py flags>

prints lines "expert rows: [r1, r2, ...]", one count per layer of rank 0's stage, then, after the bias update,
"expert bias: largest |bias| B, spread over the stage's ranks S" (S: the largest difference of any layer's bias
between two ranks of the stage)."""
import sys


def install():
    import torch
    import torch.distributed as dist
    from deepspeed.moe.ep_experts import GroupedExperts

    from megatron_ds.training import loop
    rows = {}
    forward, update = GroupedExperts.forward, loop.update_expert_bias

    def counting_forward(self, x, num_tokens_per_expert):
        rows[id(self)] = rows.get(id(self), 0) + x.shape[0]
        return forward(self, x, num_tokens_per_expert)

    def reporting(layers, groups=()):
        computed = torch.tensor([float(rows.pop(id(layer.experts), 0)) for layer in layers])
        for group in groups:
            dist.all_reduce(computed, group=group)
        if dist.get_rank() == 0:
            print(f"expert rows: {[int(count) for count in computed.tolist()]}", flush=True)
        loads = update(layers, groups)
        bias = torch.stack([layer.expert_bias for layer in layers])
        highest, lowest = bias.clone(), bias.clone()
        for group in groups:
            dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
        if dist.get_rank() == 0:
            print(f"expert bias: largest |bias| {bias.abs().max().item():.6g}, spread over the stage's ranks "
                  f"{(highest - lowest).max().item():.6g}", flush=True)
        return loads

    GroupedExperts.forward, loop.update_expert_bias = counting_forward, reporting


if __name__ == "__main__":
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py
    install()
    from megatron_ds.training import pretrain
    sys.exit(pretrain(sys.argv[1:]))
