"""megatron_ds/core/deepspeed_internals/ is the one door into DeepSpeed's internals: the version range it supports
is checked at start-up, and nothing else reaches a private name it owns, overrides a private method of a DeepSpeed
class in a subclass, or assigns an object's __class__."""
import ast
import importlib
import pathlib
import re
import types

import deepspeed
import pytest
import torch

from megatron_ds.core import deepspeed_internals as internals

ROOT = pathlib.Path(__file__).resolve().parents[3]
INTERNALS = ROOT / "megatron_ds" / "core" / "deepspeed_internals"


def _uses(token):
    """A pattern for code that reaches `token`: an attribute access, an attribute name given to get/has/setattr,
    an import of it; a dotted token ("groups.mpu") matches as written."""
    name = re.escape(token)
    if "." in token:
        return re.compile(rf"\b{name}\b")
    return re.compile(rf"\.{name}\b|attr\([^)\n]*['\"]{name}['\"]|\bimport\b[^\n]*\b{name}\b")


def _scanned_files():
    files = [*(ROOT / "megatron_ds").rglob("*.py"), *(ROOT / "tools").rglob("*.py"), ROOT / "pretrain.py"]
    return [path for path in files if INTERNALS not in path.resolve().parents]


def _deepspeed_names(tree):
    """{name: dotted path} for what this module binds to DeepSpeed: `import deepspeed...` and
    `from deepspeed... import X` (as Y)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({alias.asname or "deepspeed": alias.name if alias.asname else "deepspeed"
                          for alias in node.names if alias.name.split(".")[0] == "deepspeed"})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    return names


def _dotted(expression):
    parts = []
    while isinstance(expression, ast.Attribute):
        parts.append(expression.attr)
        expression = expression.value
    return [expression.id, *reversed(parts)] if isinstance(expression, ast.Name) else None


def _deepspeed_class(base, deepspeed_names):
    """The DeepSpeed class a base-class expression names, else None."""
    parts = _dotted(base)
    if not parts or parts[0] not in deepspeed_names:
        return None
    path = deepspeed_names[parts[0]].split(".") + parts[1:]
    for split in range(len(path), 0, -1):
        try:
            found = importlib.import_module(".".join(path[:split]))
        except ImportError:
            continue
        for attribute in path[split:]:
            found = getattr(found, attribute)
        return found if isinstance(found, type) else None
    return None


def _private_overrides_and_class_swaps(source, where):
    """Methods named _x (not dunder) that a subclass of a DeepSpeed class defines where DeepSpeed's class has
    them too, and assignments to __class__."""
    tree = ast.parse(source)
    deepspeed_names = _deepspeed_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [cls for cls in (_deepspeed_class(base, deepspeed_names) for base in node.bases) if cls]
            found += [f"{where}:{item.lineno}: {node.name}.{item.name} overrides a DeepSpeed private method"
                      for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and item.name.startswith("_") and not item.name.endswith("__")
                      and any(hasattr(cls, item.name) for cls in bases)]
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        found += [f"{where}:{node.lineno}: __class__ assigned" for target in targets
                  if isinstance(target, ast.Attribute) and target.attr == "__class__"]
    return found


# --- the supported versions -----------------------------------------------------------------------------

def test_the_installed_deepspeed_is_supported():
    assert internals.deepspeed_version_errors() == []
    internals.check_deepspeed_version()


@pytest.mark.parametrize("version", ["0.19.8", "0.19.9", "0.19.8+cu124", "0.19.12"])
def test_versions_inside_the_range_pass(version):
    assert internals.deepspeed_version_errors(version) == []


@pytest.mark.parametrize("version", ["0.19.7", "0.18.5", "0.20.0", "0.20.0rc1", "1.0.0", "not-a-version"])
def test_a_version_outside_the_range_is_refused_naming_both(version):
    (message,) = internals.deepspeed_version_errors(version)
    assert f"DeepSpeed {version} is installed" in message
    assert internals.SUPPORTED_DEEPSPEED in message
    with pytest.raises(RuntimeError, match=re.escape(internals.SUPPORTED_DEEPSPEED)):
        internals.check_deepspeed_version(version)


def test_pretrain_refuses_an_unsupported_deepspeed_before_anything_else(monkeypatch, capsys):
    from megatron_ds.training import pretrain
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    assert pretrain(["--no-such-flag"]) == 2  # refused before the flags are even parsed
    error = capsys.readouterr().err
    assert "DeepSpeed 0.20.1 is installed" in error and internals.SUPPORTED_DEEPSPEED in error


def test_the_package_pins_the_supported_range():
    pin = f"deepspeed{internals.SUPPORTED_DEEPSPEED}"
    assert f'"{pin}"' in (ROOT / "pyproject.toml").read_text()
    assert re.search(rf"^{re.escape(pin)}\s", (ROOT / "requirements.txt").read_text(), re.MULTILINE)


# --- one door -------------------------------------------------------------------------------------------

def test_no_other_file_reaches_the_internals_the_module_owns():
    found = []
    for path in _scanned_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {token}: {line.strip()}"
                      for token in internals.OWNED_NAMES if _uses(token).search(line)]
    assert not found, "DeepSpeed internals outside megatron_ds/core/deepspeed_internals/:\n" + "\n".join(found)


def test_no_other_file_overrides_deepspeed_privates_or_swaps_a_class():
    found = [problem for path in _scanned_files()
             for problem in _private_overrides_and_class_swaps(path.read_text(), path.relative_to(ROOT))]
    assert not found, "outside megatron_ds/core/deepspeed_internals/:\n" + "\n".join(found)


SUBCLASS = "from deepspeed.runtime.pipe.module import PipelineModule\nclass M(PipelineModule):\n    def {}(self): pass"


@pytest.mark.parametrize("source", [
    "from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine as E\nclass F(E):\n    def _train_schedule(s): pass",
    "import deepspeed\nclass M(deepspeed.pipe.PipelineModule):\n    def _partition_layers(self): pass",
    "from deepspeed.runtime.pipe import module as m\nclass M(m.PipelineModule):\n    def _build(self): pass",
    "def swap(engine, kind):\n    engine.__class__ = kind",
])
def test_the_scan_sees_an_override_or_a_class_swap(source):
    assert _private_overrides_and_class_swaps(source, "x.py")


@pytest.mark.parametrize("source", [
    SUBCLASS.format("__init__"), SUBCLASS.format("_our_helper"), SUBCLASS.format("forward"),
    "class Mine:\n    def _helper(self): pass",
])
def test_the_scan_leaves_public_overrides_and_our_classes_alone(source):
    assert not _private_overrides_and_class_swaps(source, "x.py")


def test_every_owned_name_is_used_by_the_package():
    init = (INTERNALS / "__init__.py").read_text()
    source = init.split("OWNED_NAMES = (", 1)[1].split("\n)\n", 1)[1] + "".join(
        path.read_text() for path in INTERNALS.glob("*.py") if path.name != "__init__.py")
    assert [token for token in internals.OWNED_NAMES if not re.search(rf"\b{re.escape(token)}\b", source)] == []


@pytest.mark.parametrize("line", ["engine._INSTRUCTION_MAP = timed", "mapping = getattr(param, '_hp_mapping', None)",
                                  "from deepspeed.moe.mappings import _gather_tokens",
                                  "deepspeed.utils.groups.mpu = ModelParallelUnit()",
                                  "if hasattr(optimizer, \"loss_scaler\"):", "backend = deepspeed.comm.comm.cdb"])
def test_the_scan_sees_a_reintroduced_internal(line):
    assert any(_uses(token).search(line) for token in internals.OWNED_NAMES)


@pytest.mark.parametrize("line", ["def _gather_tokens_over_gloo(input_, dim=0):",
                                  "from megatron_ds.engine.mpu import ModelParallelUnit",
                                  "from megatron_ds.checkpointing.state import read_loss_scaler",
                                  "from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import X",
                                  "return metrics.loss_scale(engine)"])
def test_the_scan_leaves_our_own_names_alone(line):
    assert not any(_uses(token).search(line) for token in internals.OWNED_NAMES)


# --- a few of the doors, without a process group --------------------------------------------------------

def test_pipeline_instructions_are_wrapped_on_the_engine_only():
    class Engine:
        _INSTRUCTION_MAP = {int: lambda self: "forward"}

    engine = Engine()
    internals.wrap_pipeline_instructions(engine, lambda kind, function: lambda self: f"timed {function(self)}")
    assert engine._INSTRUCTION_MAP[int](engine) == "timed forward"
    assert Engine._INSTRUCTION_MAP[int](engine) == "forward"


def test_parameters_are_renamed_only_inside_the_block():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = types.SimpleNamespace(param_names={a: "a", b: "b"})
    with internals.parameters_named(optimizer, {a: "saved.a", b: "saved.b"}):
        assert optimizer.param_names == {a: "saved.a", b: "saved.b"}
    assert optimizer.param_names == {a: "a", b: "b"}


def test_an_expert_group_deepspeed_does_not_know_has_rank_0():
    assert internals.expert_parallel_rank("ep_size_no_such_group") == 0
    assert internals.expert_data_parallel_rank("ep_size_no_such_group") == 0


def test_the_model_parallel_unit_goes_in_and_out(monkeypatch):
    from deepspeed.utils import groups
    monkeypatch.setattr(groups, "mpu", None)  # restored afterwards
    unit = object()
    internals.set_model_parallel_unit(unit)
    assert internals.model_parallel_unit() is unit


def test_a_plain_torch_optimizer_has_no_deepspeed_partitions():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert internals.fp32_partition_groups(optimizer) is None
    assert internals.bit16_parameter_groups(optimizer) is None
    assert internals.dense_bf16_flat_gradients(optimizer) is None
    assert internals.hp_mapping(torch.nn.Parameter(torch.zeros(2))) is None


def test_the_loss_scale_is_cur_scale_then_loss_scale_then_1():
    assert internals.loss_scale(types.SimpleNamespace(cur_scale=8, loss_scale=4)) == 8.0
    assert internals.loss_scale(types.SimpleNamespace(loss_scale=4)) == 4.0
    assert internals.loss_scale(object()) == 1.0
