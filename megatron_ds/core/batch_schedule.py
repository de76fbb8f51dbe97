"""Megatron's batch-size ramp-up (--rampup-batch-size START INCREMENT SAMPLES): the global batch grows
from START by INCREMENT, evenly over the first SAMPLES consumed samples, up to --global-batch-size.
The micro-batch size is fixed; DeepSpeed's set_train_batch_size changes gradient accumulation."""


class ConstantBatchSize:
    def __init__(self, global_batch_size):
        self.global_batch_size_at_end = global_batch_size

    def global_batch_size(self, consumed_samples):
        return self.global_batch_size_at_end


class RampupBatchSize:
    def __init__(self, start, increment, ramp_samples, global_batch_size, micro_batch_size, data_parallel_size):
        errors = rampup_errors(start, increment, ramp_samples, global_batch_size, micro_batch_size,
                               data_parallel_size)
        if errors:
            raise ValueError("; ".join(errors))
        self.start, self.increment, self.global_batch_size_at_end = start, increment, global_batch_size
        steps = (global_batch_size - start) // increment
        self.samples_per_step = ramp_samples / steps if steps else float("inf")

    def global_batch_size(self, consumed_samples):
        steps = int(consumed_samples / self.samples_per_step)
        return min(self.start + steps * self.increment, self.global_batch_size_at_end)


def rampup_errors(start, increment, ramp_samples, global_batch_size, micro_batch_size, data_parallel_size):
    unit = micro_batch_size * data_parallel_size
    flag = f"--rampup-batch-size {start} {increment} {ramp_samples}"
    if start <= 0 or increment <= 0 or ramp_samples < 0:
        return [f"{flag}: START and INCREMENT must be positive and SAMPLES >= 0"]
    errors = []
    if start > global_batch_size or (global_batch_size - start) % increment:
        errors.append(f"{flag}: --global-batch-size {global_batch_size} must be START plus a whole number of "
                      f"INCREMENTs")
    if start % unit or increment % unit:
        errors.append(f"{flag}: START and INCREMENT must be multiples of --micro-batch-size {micro_batch_size} x "
                      f"data-parallel size {data_parallel_size} = {unit}")
    return errors


def build_batch_schedule(args):
    if not args.rampup_batch_size:
        return ConstantBatchSize(args.global_batch_size)
    start, increment, samples = args.rampup_batch_size
    return RampupBatchSize(start, increment, samples, args.global_batch_size, args.micro_batch_size,
                           args.data_parallel_size)
