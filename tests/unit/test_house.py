"""The house rules, read from the code: every package's docstring names every module in it (tools/house_map.py),
docs/architecture.md carries that map, the packages import in the root docstring's dependency order (never
upward, never inside a function), and no module name repeats across packages."""
import ast
import collections

import pytest

from tools import house_map

ROOT = house_map.ROOT
ORDER = house_map.dependency_order()


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return sorted(house_map.PACKAGE.rglob("*.py"))


def _layer(dotted):
    """The index in ORDER of the package holding megatron_ds.<dotted>: the longest entry it starts with."""
    matches = [index for index, name in enumerate(ORDER) if dotted == name or dotted.startswith(name + ".")]
    return max(matches, key=lambda index: len(ORDER[index])) if matches else None


def _project_imports(source, module, is_package=False):
    """[(line, imported module under megatron_ds, inside a function or class)] of the module `module` (dotted)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if isinstance(child, ast.ImportFrom):
                base = _absolute(child.module, child.level, package)
                if base.split(".")[0] == "megatron_ds":
                    found.extend((child.lineno, _submodule_or_package(base, alias.name), inner)
                                 for alias in child.names)
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, inner) for alias in child.names
                             if alias.name.split(".")[0] == "megatron_ds")
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def _absolute(module, level, package):
    """The absolute name `from <level dots><module> import ...` means inside `package`."""
    if not level:
        return module
    parts = package.split(".")[:len(package.split(".")) - level + 1]
    return ".".join(parts + ([module] if module else []))


def _submodule_or_package(base, name):
    candidate = ROOT.joinpath(*base.split("."), name)
    return f"{base}.{name}" if candidate.with_suffix(".py").is_file() or candidate.is_dir() else base


def test_every_package_docstring_names_exactly_its_modules():
    problems = []
    for package in house_map.packages():
        named = {name for name, _ in house_map.entries(package) if "/" not in name.rstrip("/")}
        where = package.relative_to(ROOT)
        problems += [f"{where}/__init__.py does not name {name}" for name in sorted(house_map.members(package) - named)]
        problems += [f"{where}/__init__.py names {name}, which is not there"
                     for name in sorted(named - house_map.members(package))]
    assert not problems, "\n".join(problems)


def test_the_dependency_order_names_every_top_level_package_once():
    top_level = {name.rstrip("/") for name in house_map.members(house_map.PACKAGE) if name.endswith("/")}
    assert sorted(name for name in ORDER if "." not in name) == sorted(top_level)
    assert len(ORDER) == len(set(ORDER))


def test_architecture_md_carries_the_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert house_map.with_tree(text) == text, "docs/architecture.md's map is stale: python tools/house_map.py " \
                                              "--write docs/architecture.md"


def test_packages_import_only_downward_and_at_the_top_of_a_module():
    problems = []
    for path in _modules():
        source = _module_name(path).removeprefix("megatron_ds").lstrip(".")
        for line, target, inside in _project_imports(path.read_text(), _module_name(path), path.name == "__init__.py"):
            target = target.removeprefix("megatron_ds").lstrip(".")
            where = f"{path.relative_to(ROOT)}:{line}: imports megatron_ds.{target}"
            if inside:
                problems.append(f"{where} inside a function or class")
            elif source and (_layer(target) is None or _layer(target) > _layer(source)):
                problems.append(f"{where}, which the dependency order puts after {ORDER[_layer(source)]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("from megatron_ds.training import loop\n", [(1, "megatron_ds.training.loop", False)]),
    ("def f():\n    from megatron_ds.launch import runtime\n", [(2, "megatron_ds.launch.runtime", True)]),
    ("from . import parallel_state\n", [(1, "megatron_ds.core.parallel_state", False)]),
    ("from ..data.builder import model_batch\n", [(1, "megatron_ds.data.builder", False)]),
    ("import megatron_ds.engine.mpu as mpu\nimport torch\n", [(1, "megatron_ds.engine.mpu", False)]),
])
def test_the_import_scan_reads_each_form_of_import(source, expected):
    assert _project_imports(source, "megatron_ds.core.probe") == expected


def test_the_layers_put_training_above_core_and_the_dry_run_above_training():
    assert _layer("core.parallel_state") < _layer("training.loop") < _layer("planning.dry_run.fake_rank")
    assert _layer("planning.memory") < _layer("training.loop")


def test_module_names_are_unique_across_packages():
    names = collections.Counter(path.name for path in _modules() if path.name != "__init__.py")
    names.update(path.name for path in house_map.PACKAGE.rglob("*") if (path / "__init__.py").is_file())
    assert [name for name, count in names.items() if count > 1] == []
