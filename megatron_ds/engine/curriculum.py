"""Megatron-DeepSpeed's legacy sequence-length curriculum: the DeepSpeed JSON's "curriculum_learning" block.

DeepSpeed 0.19 no longer accepts the block in its config, so the glue takes it out of what DeepSpeed sees and
runs it here, with DeepSpeed's own CurriculumScheduler: before iteration i the scheduler's difficulty for
step i is the sequence length, and every training micro-batch is cut to its first that-many tokens (as
Megatron-DeepSpeed's get_batch does). Evaluation runs at the full --seq-length. The difficulty is a function
of the iteration, so a resumed run repeats the uninterrupted one without any saved state.
"""
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

BLOCK = "curriculum_learning"
# schedule_type -> the keys its schedule_config must hold
_SCHEDULE_KEYS = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                  "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                  "fixed_discrete": ("difficulty", "max_step")}


def enabled_block(config):
    """The user's enabled curriculum block, or None."""
    block = config.get(BLOCK)
    return block if isinstance(block, dict) and block.get("enabled", False) is not False else None


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def curriculum_errors(block, path, seq_length, length_divisor):
    """Everything wrong with an enabled block, all at once. length_divisor: what every sequence length must
    be a multiple of (the ranks that split the sequence: TP with --sequence-parallel, times Ulysses SP)."""
    key = f'"{BLOCK}"'
    errors = []
    if block.get("curriculum_type", "seqlen") != "seqlen":
        errors.append(f'{key}: {{"curriculum_type": "{block["curriculum_type"]}"}} in {path}: the legacy curriculum '
                      f'only knows "seqlen"')
    low, high = block.get("min_difficulty"), block.get("max_difficulty")
    for name, value in (("min_difficulty", low), ("max_difficulty", high)):
        if not _positive_int(value):
            errors.append(f"{key}: {name} {value!r} in {path} must be a positive integer (a sequence length)")
    if _positive_int(low) and _positive_int(high) and not low <= high <= seq_length:
        errors.append(f"{key}: min_difficulty {low} <= max_difficulty {high} <= --seq-length {seq_length} must hold "
                      f"in {path}")
    errors += _schedule_errors(block, key, path)
    if length_divisor > 1 and not errors:
        errors += _divisibility_errors(block, key, path, length_divisor)
    return errors


def _schedule_errors(block, key, path):
    kind = block.get("schedule_type")
    if kind not in _SCHEDULE_KEYS:
        return [f"{key}: schedule_type {kind!r} in {path} must be one of {', '.join(_SCHEDULE_KEYS)} (a custom "
                f"schedule needs a Python function: not available from a launch script)"]
    schedule = block.get("schedule_config")
    if not isinstance(schedule, dict):
        return [f"{key}: schedule_config in {path} must be an object with {', '.join(_SCHEDULE_KEYS[kind])}"]
    missing = [name for name in _SCHEDULE_KEYS[kind] if name not in schedule]
    if missing:
        return [f"{key}: schedule_config in {path} lacks {', '.join(missing)} (needed by {kind})"]
    if kind == "fixed_discrete":
        difficulties, steps = schedule["difficulty"], schedule["max_step"]
        if not (isinstance(difficulties, list) and isinstance(steps, list) and steps
                and len(difficulties) == len(steps) + 1 and all(map(_positive_int, difficulties + steps))):
            return [f"{key}: schedule_config in {path}: difficulty must list one positive length more than max_step "
                    f"lists positive steps, got {difficulties!r} and {steps!r}"]
        return []
    return [f"{key}: schedule_config.{name} {schedule[name]!r} in {path} must be a positive integer"
            for name in _SCHEDULE_KEYS[kind] if not _positive_int(schedule[name])]


def _divisibility_errors(block, key, path, divisor):
    """DeepSpeed's schedules give multiples of difficulty_step (at least min_difficulty rounded up to one), capped
    at max_difficulty; the discrete schedule gives its listed lengths."""
    schedule = block["schedule_config"]
    if block["schedule_type"] == "fixed_discrete":
        lengths = {"schedule_config.difficulty": schedule["difficulty"]}
    else:
        lengths = {"schedule_config.difficulty_step": [schedule["difficulty_step"]],
                   "max_difficulty": [block["max_difficulty"]]}
    return [f"{key}: {name} {values if len(values) > 1 else values[0]} in {path} must be a multiple of the tensor-"
            f"parallel size {divisor}: with --sequence-parallel every sequence length is split over the TP ranks"
            for name, values in lengths.items() if any(value % divisor for value in values)]


class SequenceLengthCurriculum:
    """The sequence length of each training iteration; `length` is the current one."""

    def __init__(self, block, seq_length):
        self._scheduler = CurriculumScheduler(block)
        self.length = seq_length

    def advance_to(self, iteration):
        """The length for `iteration` (DeepSpeed's difficulty at that global step), now also `length`."""
        self.length = self._scheduler.update_difficulty(iteration)
        return self.length
