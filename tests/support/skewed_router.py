"""pretrain.py with every dropless MoE router skewed toward its first two experts: their gate logits raised by
SKEW for every token (a router that favours a few experts, as a badly initialised or drifted one does):

    torchrun --nproc_per_node 2 -m tests.support.skewed_router SKEW <pretrain.py flags>"""
import sys


def install(skew):
    from megatron_ds.core.transformer.dropless_moe import dropless_layers
    from megatron_ds.training import initialize
    setup_engine = initialize.setup_engine

    def raised(module, inputs, output):
        output = output.clone()
        output[..., :2] += skew
        return output

    def setup_and_skew(*args, **kwargs):
        engine = setup_engine(*args, **kwargs)
        for layer in dropless_layers(engine.module):
            layer.router.gate.register_forward_hook(raised)
        return engine

    initialize.setup_engine = setup_and_skew


if __name__ == "__main__":
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py
    install(float(sys.argv[1]))
    from megatron_ds.training import pretrain
    sys.exit(pretrain(sys.argv[2:]))
