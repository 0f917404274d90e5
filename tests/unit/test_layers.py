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
