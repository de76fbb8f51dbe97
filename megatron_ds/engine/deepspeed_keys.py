"""The keys a DeepSpeed JSON may hold. DeepSpeed ignores an unknown top-level key silently (a typo such as
"zero_optimisation" simply leaves ZeRO off), so each key is checked against the ones DeepSpeed's own config
parser reads: it parses a minimal config held in a dict that records every key looked up. The
`zero_optimization` block is checked against DeepSpeed's ZeRO config fields (DeepSpeed would refuse an unknown
one only at engine start-up, in a validation traceback)."""
import difflib
import functools


class _RecordingKeys:
    """What dict.keys() returns in a _RecordingDict: `key in config.keys()` is a lookup too."""

    def __init__(self, owner):
        self._owner = owner

    def __contains__(self, key):
        self._owner.looked_up.add(key)
        return dict.__contains__(self._owner, key)

    def __iter__(self):
        return iter(dict.keys(self._owner))

    def __len__(self):
        return dict.__len__(self._owner)


class _RecordingDict(dict):
    def __init__(self, values, looked_up=None):
        super().__init__(values)
        self.looked_up = set() if looked_up is None else looked_up

    def get(self, key, default=None):
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.looked_up.add(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self.looked_up.add(key)
        return super().setdefault(key, default)

    def keys(self):
        return _RecordingKeys(self)

    def __copy__(self):  # DeepSpeed parses a copy
        return _RecordingDict(self, self.looked_up)


@functools.lru_cache(maxsize=None)
def top_level_keys():
    """The top-level keys DeepSpeed's config parser reads (frozenset)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    config = _RecordingDict({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                             "gradient_accumulation_steps": 1})
    DeepSpeedConfig(config)
    return frozenset(key for key in config.looked_up if isinstance(key, str))


@functools.lru_cache(maxsize=None)
def zero_keys():
    """The keys of DeepSpeed's `zero_optimization` block (field names and their aliases)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    fields = DeepSpeedZeroConfig.model_fields
    return frozenset([*fields, *(field.alias for field in fields.values() if field.alias)])


def unknown_key_errors(config, path):
    """One message per key DeepSpeed would not read, with the closest known key."""
    errors = [_unknown(key, top_level_keys(), path) for key in config if key not in top_level_keys()]
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        errors += [_unknown(key, zero_keys(), path, block="zero_optimization")
                   for key in zero if key not in zero_keys()]
    return errors


def _unknown(key, known, path, block=None):
    where = f"\"{block}.{key}\"" if block else f"\"{key}\""
    closest = difflib.get_close_matches(str(key), sorted(known), n=1)
    hint = f" (did you mean \"{closest[0]}\"?)" if closest else ""
    return f"{path}: unknown DeepSpeed key {where}{hint}"
