"""Command lines shared by tests: the smallest model pretrain.py accepts with mock data, a DeepSpeed JSON that
offloads the optimizer, and the first line pretrain.py prints for a bad command line."""
TINY_MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data "
              "--vocab-size 128").split()
OFFLOAD = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
HEADER = "megatron_ds: error: invalid arguments:"


def parse_with_deepspeed_json(folder, argv, ds=None, world=1):
    """parse_args(argv) at world size `world`; with ds (a dict), also --deepspeed_config <ds written to folder>."""
    import json

    from megatron_ds.arguments import parse_args
    if ds is not None:
        path = folder / "ds.json"
        path.write_text(json.dumps(ds))
        argv = list(argv) + ["--deepspeed_config", str(path)]
    return parse_args(list(argv), world_size=world)
