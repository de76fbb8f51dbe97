"""A small MLP in DeepSpeed's plain or pipeline engine with its BF16_Optimizer (bf16, fp32 gradient accumulation,
ZeRO-1), each data-parallel rank with data of its own: what the gradient-reduction tests train."""
import deepspeed
import torch
import torch.distributed as dist

HIDDEN = 24
DS_CONFIG = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
             "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
             "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}


def _squared_error(output, target):
    return (output.float() - target.float()).pow(2).mean()


def _layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(2 * HIDDEN, HIDDEN)]


def rank_batches():
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each data-parallel rank its own data
    while True:
        yield (torch.randn(3, HIDDEN, generator=generator).bfloat16(),
               torch.randn(3, HIDDEN, generator=generator).bfloat16())


def bf16_engine(pipelined, config):
    if pipelined:
        model = deepspeed.pipe.PipelineModule(layers=_layers(), num_stages=1, loss_fn=_squared_error)
    else:
        model = torch.nn.Sequential(*_layers())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    return engine


def train_step(engine, batches):
    if isinstance(engine, deepspeed.PipelineEngine):
        engine.train_batch(data_iter=batches)
        return
    inputs, target = next(batches)
    engine.backward(_squared_error(engine(inputs), target))
    engine.step()
