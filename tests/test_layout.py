"""The package's shape: imports run downward through the phases, with no circles and no private
names borrowed across modules (docs/explanation/layout.md).

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
LAYERS = ["leaf", "data", "parallel", "state", "outputs", "guard", "engine", "tools", "face"]
LEAVES = {"errors", "version", "config_fields", "config_training", "config_running", "config",
          "specs", "extras", "callbacks"}
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
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d in g and not state.get(d):
                visit(d, [*stack, d])
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


@pytest.mark.parametrize("pkg", [
    "data", "parallel", "state", "outputs", "guard", "engine", "tools"])
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


# --- the run's shape (issue 28) ------------------------------------------------------------

#: The kinds of training input; which one a run reads is decided once, in data/.
INPUT_KINDS = {"Stream", "StreamOrder", "EpochSampler", "MapSource", "IterableDataset"}
MAX_RUN_FIELDS = 12
MAX_FUNCTION_LINES = 60
#: Besides config.py, the modules that may read the fault knobs (``cfg.fault``).
MAX_FAULT_READERS = 2
#: ``run.a.b.c`` reads into the run's parts, three levels deep (issue 41: one attribute per fact,
#: at most two dots from the run). ``run.cfg.<section>.<key>`` is a config key's own dotted name.
MAX_DEEP_CHAINS = 5
MAX_REPORTER_PARAMS = 6


def trees() -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text()) for m, p in modules().items()}


def input_kind_checks() -> list[str]:
    """isinstance(x, <an input kind>) outside data/."""
    found = []
    for mod, tree in trees().items():
        if layer(mod) == "data":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                    and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) \
                    else [node.args[1]]
                names = {getattr(k, "id", None) or getattr(k, "attr", None) for k in kinds}
                if names & INPUT_KINDS:
                    found.append(f"{mod}:{node.lineno} isinstance on {sorted(names)}")
    return found


def long_functions() -> list[str]:
    return [f"{mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for mod, tree in trees().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def fault_readers() -> set[str]:
    return {mod for mod, tree in trees().items() if not mod.endswith(".config")
            for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "fault"}


def deep_chains() -> list[str]:
    """``run.a.b.c`` (a Name ``run`` or ``self._run``, three attributes deep), config reads
    aside."""
    found = []
    for mod, tree in trees().items():
        for node in ast.walk(tree):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if len(chain) == 3 and isinstance(cur, ast.Name) and cur.id == "run" \
                    and chain[-1] != "cfg":
                found.append(f"{mod}:{node.lineno} run.{'.'.join(reversed(chain))}")
    return found


def classes_defined_twice() -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for mod, tree in trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(mod)
    return {name: mods for name, mods in where.items() if len(mods) > 1}


def test_the_run_is_a_few_typed_parts():
    import dataclasses

    from ironloop.engine.run import Run

    fields = dataclasses.fields(Run)
    assert len(fields) <= MAX_RUN_FIELDS, [f.name for f in fields]
    untyped = [f.name for f in fields if "Any" in str(f.type) or str(f.type) == "object"]
    assert not untyped, f"typed Any: {untyped}"


def test_each_fact_is_at_most_two_dots_from_the_run():
    assert len(deep_chains()) <= MAX_DEEP_CHAINS, "\n".join(deep_chains())


def test_the_guard_reporter_takes_its_own_parts_only():
    import inspect

    from ironloop.guard.reporter import GuardReporter

    params = list(inspect.signature(GuardReporter.__init__).parameters)[1:]
    assert len(params) <= MAX_REPORTER_PARAMS, params


def test_no_class_name_is_defined_twice():
    assert not classes_defined_twice(), classes_defined_twice()


def test_the_input_kind_is_decided_in_data_only():
    assert not input_kind_checks(), "\n".join(input_kind_checks())


def test_no_function_is_over_60_lines():
    assert not long_functions(), "\n".join(long_functions())


def test_the_fault_knobs_are_read_in_few_modules():
    assert len(fault_readers()) <= MAX_FAULT_READERS, sorted(fault_readers())


def test_the_shape_checks_can_fail(tmp_path, monkeypatch):
    """The checks above see an isinstance on a stream, a long function, fault reads in three
    modules, a class defined twice and a chain three deep in a fake package."""
    fake = tmp_path / "ironloop"
    (fake / "engine").mkdir(parents=True)
    for d in (fake, fake / "engine"):
        (d / "__init__.py").write_text("")
    (fake / "engine" / "a.py").write_text("def f(x):\n    return isinstance(x, Stream)\n")
    body = "".join(f"    y = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (fake / "engine" / "b.py").write_text(f"def g(cfg):\n{body}    return cfg.fault\n")
    (fake / "engine" / "c.py").write_text("def h(cfg):\n    return cfg.fault\n")
    (fake / "engine" / "d.py").write_text("def k(cfg):\n    return cfg.fault\n"
                                          "class Plan:\n    pass\n")
    (fake / "engine" / "e.py").write_text("class Plan:\n    pass\n"
                                          "def m(run):\n    return run.data.source.usable\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert input_kind_checks() == ["ironloop.engine.a:2 isinstance on ['Stream']"]
    assert long_functions() == [f"ironloop.engine.b.g: {MAX_FUNCTION_LINES + 2} lines"]
    assert len(fault_readers()) == 3
    assert classes_defined_twice() == {"Plan": ["ironloop.engine.d", "ironloop.engine.e"]}
    assert deep_chains() == ["ironloop.engine.e:4 run.data.source.usable"]


# --- one checkpointer and one run directory (issue 54) -------------------------------------

#: The writers and finders of checkpoints that only the checkpointer may reach (besides the
#: modules that define them): a resume, a rollback, export and the doctor go through it.
CHECKPOINT_INTERNALS = {"FileWriter", "ShardedWriter", "latest_file", "latest_sharded",
                        "load_sharded", "load_extras", "read_extras", "consolidate_model"}
CHECKPOINTER = {"ironloop.state.checkpointer", "ironloop.state.file_writer", "ironloop.state.dcp"}


def checkpoint_routes() -> list[str]:
    """Uses of the checkpoint writers and finders (a call, an isinstance) outside the
    checkpointer."""
    found = []
    for mod, tree in trees().items():
        if mod in CHECKPOINTER:
            continue
        for node in ast.walk(tree):
            name = getattr(node, "id", None) or getattr(node, "attr", None)
            if isinstance(node, (ast.Name, ast.Attribute)) and name in CHECKPOINT_INTERNALS:
                found.append(f"{mod}:{node.lineno} {name}")
    return found


def checkpoints_literals() -> list[str]:
    """The lines of the package that spell the checkpoints folder's name."""
    return [f"{p.relative_to(PKG)}:{i}" for p in sorted(PKG.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if '"checkpoints"' in line]


def test_one_checkpointer_writes_and_finds_checkpoints():
    assert not checkpoint_routes(), "\n".join(checkpoint_routes())


def test_the_checkpoints_folder_is_named_in_one_place():
    assert len(checkpoints_literals()) <= 2, checkpoints_literals()


def test_the_checkpointer_checks_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "ironloop"
    (fake / "guard").mkdir(parents=True)
    for d in (fake, fake / "guard"):
        (d / "__init__.py").write_text("")
    (fake / "guard" / "a.py").write_text(
        "from ironloop.state.file_writer import latest_file\n"
        "def f(d):\n    return latest_file(d / \"checkpoints\", print)\n"
        "def g(w):\n    return isinstance(w, ShardedWriter)\n")
    (fake / "guard" / "b.py").write_text('A = "checkpoints"\nB = "checkpoints"\n')
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert checkpoint_routes() == ["ironloop.guard.a:3 latest_file",
                                   "ironloop.guard.a:5 ShardedWriter"]
    assert checkpoints_literals() == ["guard/a.py:3", "guard/b.py:1", "guard/b.py:2"]


def test_tune_is_a_subpackage_like_doctor_and_lab():
    for pkg in ("tune", "doctor", "lab"):
        assert (PKG / "tools" / pkg / "__init__.py").is_file(), pkg
    assert not list((PKG / "tools").glob("tune_*.py"))


# --- the tests mirror the package (issue 54) ------------------------------------------------

TESTS = Path(__file__).resolve().parent
#: The folder of the suites that run the whole product (CLI kill/resume, fault injection,
#: torchrun, SLURM, the docs and the README), whatever modules they reach.
E2E = "e2e"
#: Root test files that check the repository rather than one module.
WHOLE_REPO = {"test_layout.py", "test_lint.py", "test_named_mutants.py", "test_mutants_sample.py"}
MAX_TEST_FILE_LINES = 800


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def misplaced_tests() -> list[str]:
    """Test files below the root outside a folder named after a package of src/ironloop (or
    e2e/), and test folders that are not packages (``from tests.x.test_y import`` needs them)."""
    bad = []
    for path in _test_files():
        folder = path.parent.relative_to(TESTS)
        if folder == Path("."):
            continue
        name = str(path.relative_to(TESTS))
        if folder.parts[0] != E2E and not (PKG / folder / "__init__.py").is_file():
            bad.append(f"{name}: no package src/ironloop/{folder.as_posix()}")
        if not (path.parent / "__init__.py").is_file():
            bad.append(f"{name}: no __init__.py beside it")
    return bad


def root_tests_of_no_top_level_module() -> list[str]:
    """Root test files are test_<top-level module>[_topic].py, or whole-repository checks."""
    tops = sorted((p.stem for p in PKG.glob("*.py") if not p.stem.startswith("_")),
                  key=len, reverse=True)
    return [p.name for p in sorted(TESTS.glob("test_*.py")) if p.name not in WHOLE_REPO
            and not any(p.stem == f"test_{m}" or p.stem.startswith(f"test_{m}_") for m in tops)]


def units_files() -> list[str]:
    return [p.relative_to(TESTS).as_posix() for p in sorted(TESTS.rglob("*_units.py"))]


def long_test_files() -> list[str]:
    return [p.relative_to(TESTS).as_posix() for p in _test_files()
            if len(p.read_text().splitlines()) > MAX_TEST_FILE_LINES]


def test_every_test_file_sits_in_the_folder_of_the_package_it_tests():
    assert misplaced_tests() == []
    assert root_tests_of_no_top_level_module() == []


def test_no_units_twin_and_no_test_file_over_800_lines():
    assert units_files() == []
    assert long_test_files() == []


def test_the_test_layout_checks_find_what_they_look_for(tmp_path, monkeypatch):
    fake_pkg, fake_tests = tmp_path / "src" / "ironloop", tmp_path / "tests"
    for pkg in ("", "engine", "tools", "tools/lab"):
        (fake_pkg / pkg).mkdir(parents=True, exist_ok=True)
        (fake_pkg / pkg / "__init__.py").write_text("")
    (fake_pkg / "config.py").write_text("")
    for folder in ("", "engine", "tools/lab", "e2e", "nowhere"):
        (fake_tests / folder).mkdir(parents=True, exist_ok=True)
    for folder in ("", "engine", "tools/lab", "e2e"):
        (fake_tests / folder / "__init__.py").write_text("")
    for name in ("test_config.py", "test_config_keys.py", "test_lint.py", "test_loop.py",
                 "engine/test_loop.py", "tools/lab/test_run.py", "e2e/test_kill.py",
                 "nowhere/test_x.py", "engine/test_loop_units.py"):
        (fake_tests / name).write_text("x = 1\n" * (MAX_TEST_FILE_LINES + name.count("run")))
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake_pkg)
    monkeypatch.setattr(sys.modules[__name__], "TESTS", fake_tests)
    assert misplaced_tests() == ["nowhere/test_x.py: no package src/ironloop/nowhere",
                                 "nowhere/test_x.py: no __init__.py beside it"]
    assert root_tests_of_no_top_level_module() == ["test_loop.py"]
    assert units_files() == ["engine/test_loop_units.py"]
    assert long_test_files() == ["tools/lab/test_run.py"]
