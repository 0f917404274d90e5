"""The house's floors: arrows run down only (docs/architecture.md, "Layout")."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "livemig"


def _imports(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_nothing_below_the_facade_imports_it():
    offenders = []
    for floor in ("runtime", "sandbox", "comm", "transfer", "rdzv"):
        for f in sorted((PKG / floor).rglob("*.py")):
            if any(m == "livemig.api" or m.startswith("livemig.api.") for m in _imports(f)):
                offenders.append(str(f.relative_to(PKG.parent)))
    assert not offenders, f"these import livemig.api, which sits above them: {offenders}"


def test_registry_is_the_bottom_of_runtime():
    mods = _imports(PKG / "runtime" / "registry.py")
    assert not [m for m in mods if m.startswith("livemig.runtime")], mods


def test_the_facade_stays_short():
    n = len((PKG / "api.py").read_text().splitlines())
    assert n <= 300, f"livemig/api.py has {n} lines: move protocol code into livemig/runtime/"


def _import_time_nodes(tree: ast.Module):
    """What runs when the module is imported: module-level statements and class bodies,
    not function bodies (nor lambdas: a dataclass default_factory runs at construction)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def test_no_module_reads_the_environment_at_import():
    """A setting read at import is fixed before a test, a launcher or an operator can set
    it for the process: every LIVEMIG_* value is read when used."""
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        for node in _import_time_nodes(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert not offenders, f"os.environ read at import: {offenders}"


def test_every_livemig_setting_is_named_in_config():
    """One schema for the environment: `ENV_X = "LIVEMIG_..."` only in livemig/config.py."""
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        if f == PKG / "config.py":
            continue
        for node in ast.parse(f.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str) and node.value.value.startswith("LIVEMIG_")):  # fmt: skip
                offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert not offenders, f"LIVEMIG_* names defined outside livemig/config.py: {offenders}"
