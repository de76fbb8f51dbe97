"""megatron_ds.observability.metrics in process: the timers, the iteration line's added fields, and the whole-model
statistics (params norm, optimizer-state norms, zeros in the gradients) on real DeepSpeed engines of every
optimizer layout (2 gloo ranks, data-parallel), against DeepSpeed's own accessors of the full states."""
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_ds.observability import metrics
from tests.support.distributed import run_distributed
from tests.support.launch import LOSS_LINE

# --- timers -------------------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """metrics' perf_counter, advanced by hand."""
    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    return now


def test_timers_keep_the_names_of_their_level_and_a_nested_call_pauses_the_outer_one(clock):
    timers = metrics.Timers(level=2)

    def reduce():
        clock[0] += 3.0

    def backward():
        clock[0] += 1.0
        timed_reduce()
        clock[0] += 2.0

    timed_reduce = timers.timed(("grads-all-reduce",), reduce)
    timers.timed(("forward-backward", "backward-compute"), backward)()
    assert timers.elapsed["backward-compute"] == 3.0 and timers.elapsed["forward-backward"] == 3.0
    assert timers.elapsed["grads-all-reduce"] == 3.0

    level_1 = metrics.Timers(level=1)
    assert set(level_1.elapsed) == {"forward-backward", "embedding-grads-all-reduce", "grads-all-reduce", "optimizer"}
    assert not metrics.Timers(level=0).active
    untimed = lambda: None  # noqa: E731
    assert metrics.Timers(level=0).timed(("forward-backward",), untimed) is untimed
    skipped = level_1.timed(("optimizer",), lambda: clock.__setitem__(0, clock[0] + 5.0), when=lambda: False)
    skipped()  # evaluation: not timed
    assert level_1.elapsed["optimizer"] == 0.0


def test_timer_report_is_megatrons():
    text = metrics._timers_text({"forward-backward": (0.0101, 0.0214), "optimizer": (0.008, 0.0082)})
    assert text.splitlines() == ["(min, max) time across ranks (ms):",
                                 "    forward-backward ...............................: (10.10, 21.40)",
                                 "    optimizer ......................................: (8.00, 8.20)"]


# --- the iteration line -------------------------------------------------------------------------------

def _line(**statistics):
    logger = metrics.MetricsLogger.__new__(metrics.MetricsLogger)
    logger.config = SimpleNamespace(train_iters=10, fp16=False)
    scalars = {"consumed-samples": 16, "consumed-tokens": 512, "learning-rate": 3e-3, "lm loss": 5.25,
               "loss-scale": 1.0, "grad-norm": 1.5,
               "tokens-per-second": 100.0, "tflops-per-device": 0.01, "mfu": 0.1, **statistics}
    return logger._line(2, 0.1234, 8, scalars, engine=None)


def test_iteration_line_adds_num_zeros_and_params_norm_where_megatron_prints_them():
    plain = _line()
    assert plain == (" iteration 2/10 | consumed samples: 16 | consumed tokens: 512 | elapsed time per iteration "
                     "(ms): 123.4 | learning rate: 3.000000E-03 | global batch size: 8 | lm loss: 5.250000E+00 | "
                     "loss scale: 1.0 | grad norm: 1.500 | tokens per second: 100.0 | TFLOP/s per device: 0.010 | "
                     "MFU: 10.0% |")
    full = _line(**{"num-zeros": 12.0, "params-norm": 3.14159})
    assert " grad norm: 1.500 | num zeros: 12.0 | params norm: 3.142 | tokens per second: 100.0 |" in full
    assert full.replace(" num zeros: 12.0 | params norm: 3.142 |", "") == plain
    assert LOSS_LINE.findall(full) == [("2", "5.250000E+00")]
    assert "num zeros" not in _line(**{"num-zeros": None})  # a skipped (fp16 overflow) step has no count
    assert " grad norm: 1.500 | curriculum seqlen: 64 | tokens per second:" in _line(**{"curriculum-seqlen": 64})


def test_tensorboard_writer_gets_the_queue_size(tmp_path):
    writers = metrics.ScalarWriters(SimpleNamespace(tensorboard_dir=str(tmp_path), tensorboard_queue_size=7,
                                                    wandb_project=""))
    assert writers.tensorboard.max_queue == 7 and writers.wandb is None
    writers.close()


# --- whole-model statistics on DeepSpeed engines ------------------------------------------------------

IN, OUT, ZERO_INPUTS = 23, 46, 5  # odd sizes: ZeRO pads the flat partitions
CONFIGS = {
    "torch AdamW (fp32, ZeRO-0)": ({"zero_optimization": {"stage": 0}}, "AdamW"),
    "ZeRO-1 (fp32)": ({"zero_optimization": {"stage": 1}}, "DeepSpeedZeroOptimizer"),
    "ZeRO-2 (fp32)": ({"zero_optimization": {"stage": 2}}, "DeepSpeedZeroOptimizer"),
    "BF16_Optimizer": ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                        "data_types": {"grad_accum_dtype": "fp32"}}, "BF16_Optimizer"),
}


def _engine(config):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, OUT, bias=False), torch.nn.GELU(), torch.nn.Linear(OUT, IN))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_allow_untested_optimizer": True, **config}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def _train(engine, steps):
    generator = torch.Generator().manual_seed(10 + dist.get_rank())  # each data-parallel rank its own data
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        inputs = torch.randn(3, IN, generator=generator)
        inputs[:, :ZERO_INPUTS] = 0  # so the first layer's gradient has OUT x ZERO_INPUTS exact zeros
        loss = (engine(inputs.to(dtype)).float() - 1).pow(2).mean()
        engine.backward(loss)
        engine.step()


def _full_states(engine):
    """{param: (fp32 weight, exp_avg, exp_avg_sq)} through DeepSpeed's accessors (collectives)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    result = {}
    for param in engine.module.parameters():
        if hasattr(param, "_hp_mapping"):
            result[param] = (safe_get_full_fp32_param(param), safe_get_full_optimizer_state(param, "exp_avg"),
                             safe_get_full_optimizer_state(param, "exp_avg_sq"))
        else:
            state = engine.optimizer.state[param]
            result[param] = (param.detach(), state["exp_avg"], state["exp_avg_sq"])
    return result


def _expected_norms(states):
    kinds = {"variance": [s[2] for s in states], "variance_sqrt": [s[2].sqrt() for s in states],
             "momentum": [s[1] for s in states], "weight": [s[0] for s in states]}
    expected = {}
    for kind, tensors in kinds.items():
        tensors = [t.double().flatten() for t in tensors]
        expected[f"optimizer/{kind}_l2"] = math.sqrt(sum(t.pow(2).sum().item() for t in tensors))
        expected[f"optimizer/{kind}_l1"] = sum(t.abs().sum().item() for t in tensors)
        expected[f"optimizer/{kind}_abs_max"] = max(t.abs().max().item() for t in tensors)
    return expected


def _check_statistics():
    from megatron_ds.core import parallel_state
    from megatron_ds.launch.runtime import init_distributed
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    init_distributed("gloo")
    parallel_state.initialize_model_parallel(1, 1)  # 2 ranks: data-parallel
    for name, (config, optimizer_class) in CONFIGS.items():
        engine = _engine(config)
        assert type(engine.optimizer).__name__ == optimizer_class, name
        pieces = metrics.optimizer_pieces(engine)
        assert pieces is not None, name
        counter = metrics.GradientZeroCounter(engine)
        assert counter.total() is None  # nothing stepped yet
        _train(engine, steps=2)
        assert counter.total() == OUT * ZERO_INPUTS, name

        weights = [p.detach().double() for p in engine.module.parameters()]
        assert metrics.params_norm(engine) == pytest.approx(math.sqrt(sum(w.pow(2).sum().item() for w in weights)),
                                                            rel=1e-6), name
        observed = metrics.optimizer_state_norms(engine)
        expected = _expected_norms(list(_full_states(engine).values()))
        assert observed.keys() == expected.keys(), name
        for key, value in expected.items():
            assert observed[key] == pytest.approx(value, rel=1e-5), (name, key)


def test_statistics_cover_the_whole_model_once_for_every_optimizer_layout():
    run_distributed(_check_statistics, 2, timeout=300)


# --- start-up validation ------------------------------------------------------------------------------

def test_wandb_project_without_wandb_installed_is_refused_before_any_process_group(monkeypatch):
    import importlib.util

    from megatron_ds.arguments import ArgumentsError, parse_args
    from tests.support.flags import TINY_MODEL
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb"
                        else find_spec(name, *rest))
    with pytest.raises(ArgumentsError) as error:
        parse_args(TINY_MODEL + ["--wandb-project", "demo"], world_size=1)
    assert "--wandb-project demo needs the wandb package, which is not installed: pip install wandb" in str(error.value)
