"""The package's shape: imports run downward through the phases, with no circles and no private
names borrowed across modules (README, "How the code is laid out").

Every import counts, the lazy ones inside functions too: a circle through a lazy import is still
a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "ironloop"

#: The phases, lowest first. A module may import from its own phase or a lower one.
LAYERS = ["leaf", "data", "dist", "state", "outputs", "guard", "engine", "tools", "face"]
LEAVES = {"errors", "version", "config_fields", "config", "specs", "extras", "callbacks"}
FACE = {"__init__", "__main__", "cli"}
MAX_TOP_LEVEL = 12


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "face"  # the package itself: ironloop/__init__.py
    if len(parts) == 2 and parts[1] in LEAVES:
        return "leaf"
    if len(parts) == 2 and parts[1] in FACE:
        return "face"
    return parts[1]


def imports(mod: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in the file."""
    out = []
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("ironloop")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("ironloop"):
                continue
            names = [a.name for a in node.names]
            # `from ironloop.state import dcp` imports the module ironloop.state.dcp
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            out += [(s, []) for s in subs]
            rest = [n for n in names if f"{base}.{n}" not in known]
            if rest:
                out.append((base, rest))
    return out


def graph() -> dict[str, list[tuple[str, list[str]]]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_import_runs_downward():
    bad = []
    for mod, deps in graph().items():
        for dep, _ in deps:
            if dep == "ironloop" and layer(mod) != "face":
                bad.append(f"{mod} imports the package itself")
            elif LAYERS.index(layer(dep)) > LAYERS.index(layer(mod)):
                bad.append(f"{mod} ({layer(mod)}) imports {dep} ({layer(dep)})")
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    g = {m: {d for d, _ in deps if d != m} for m, deps in graph().items()}
    # A package's __init__ is imported on the way to any of its submodules, so an edge to
    # `ironloop.x.y` also passes through `ironloop.x`: that is how torch-style circles appear.
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d in g and not state.get(d):
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if not state.get(m):
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_private_names_borrowed_across_modules():
    bad = [f"{mod} takes {n} from {dep}" for mod, deps in graph().items()
           for dep, names in deps for n in names
           if n.startswith("_") and not n.startswith("__") and dep != mod]
    assert not bad, "\n".join(bad)


def test_the_top_level_is_the_public_face_only():
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    assert set(top) <= LEAVES | FACE, set(top) - LEAVES - FACE


@pytest.mark.parametrize("pkg", ["data", "dist", "state", "outputs", "guard", "engine", "tools"])
def test_each_phase_is_a_subpackage(pkg):
    assert (PKG / pkg / "__init__.py").is_file()


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a fake package with one circle and one upward import."""
    fake = tmp_path / "ironloop"
    (fake / "state").mkdir(parents=True)
    (fake / "engine").mkdir()
    for d in (fake, fake / "state", fake / "engine"):
        (d / "__init__.py").write_text("")
    (fake / "state" / "a.py").write_text("from ironloop.engine.b import run\n")
    (fake / "engine" / "b.py").write_text("def run():\n    from ironloop.state.a import _x\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    with pytest.raises(AssertionError, match="state.a .state. imports ironloop.engine.b"):
        test_every_import_runs_downward()
    with pytest.raises(AssertionError, match="ironloop.engine.b -> ironloop.state.a"):
        test_no_import_circles()
    with pytest.raises(AssertionError, match="takes _x"):
        test_no_private_names_borrowed_across_modules()
