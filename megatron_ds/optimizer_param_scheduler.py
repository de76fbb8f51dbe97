"""Megatron's learning-rate schedule: linear warmup from 0, then constant, linear or cosine decay to
--min-lr at --lr-decay-iters. Passed to DeepSpeed as the client lr_scheduler (stepped once per
applied optimizer step)."""
import math


class OptimizerParamScheduler:
    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, decay_style):
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"--min-lr {min_lr} must be between 0 and --lr {max_lr}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, warmup_steps)
        self.decay_style = decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self):
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        ratio = (self.num_steps - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        coefficient = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, increment=1):
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self):
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps, "decay_style": self.decay_style}

    def load_state_dict(self, state):
        self.num_steps = state["num_steps"]
        self.step(0)
