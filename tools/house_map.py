"""The map of megatron_ds, read from its packages' docstrings: each package's __init__.py names every module and
sub-package in it, one entry per line ("    name.py   what it does"); the root's entries, in order, are the
packages' dependency order. tests/unit/test_house.py holds both; docs/architecture.md carries the tree.

    python tools/house_map.py                          print the tree
    python tools/house_map.py --write docs/architecture.md   replace the tree between the markers there
"""
import argparse
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_ds"
BEGIN, END = "<!-- house map: tools/house_map.py writes this block -->", "<!-- end of house map -->"
ENTRY = re.compile(r"^ {4}(\w[\w/]*(?:\.py|/))\s+(.*)$")


def entries(package):
    """[(name, description)] of a package's docstring, in order (continuation lines left out)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
    return [(match.group(1), match.group(2)) for match in map(ENTRY.match, doc.splitlines()) if match]


def members(package):
    """The modules and sub-packages a package holds, as its docstring names them."""
    modules = {path.name for path in package.glob("*.py") if path.name != "__init__.py"}
    packages = {f"{path.name}/" for path in package.iterdir() if (path / "__init__.py").is_file()}
    return modules | packages


def packages(root=PACKAGE):
    """Every package under root, root included."""
    return [root, *sorted(path.parent for path in root.rglob("__init__.py") if path.parent != root)]


def dependency_order():
    """The packages in the root docstring's order, as dotted names under megatron_ds ("planning.dry_run")."""
    return [name.rstrip("/").replace("/", ".") for name, _ in entries(PACKAGE)]


def tree(package=PACKAGE, depth=0):
    """The indented tree: each entry of each package with its description, nested packages under theirs."""
    lines = [] if depth else [f"{package.name}/"]
    for name, description in entries(package):
        if name.count("/") > 1 or (name.endswith("/") and "/" in name[:-1]):
            continue  # a nested package named out of its place (the root's dependency order): its parent lists it
        lines.append(f"{'  ' * (depth + 1)}{name:<{max(34 - 2 * depth, len(name) + 1)}}{description}")
        if name.endswith("/"):
            lines += tree(package / name.rstrip("/"), depth + 1)
    return lines


def with_tree(text):
    """text with the block between the markers replaced by the tree."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n```\n" + "\n".join(tree()) + "\n```\n" + END + rest.split(END, 1)[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="MARKDOWN", help="replace the tree between the markers in this file")
    args = parser.parse_args(argv)
    if not args.write:
        print("\n".join(tree()))
        return 0
    path = pathlib.Path(args.write)
    path.write_text(with_tree(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
