"""The rooms' import arrows point down (docs/architecture.md, "Rooms and what they may touch").

Read from the source (``ast``, every import statement, module level or inside a function,
relative ones resolved), so a lazy import cannot hide an arrow pointing up:

* ``optim/`` is the math: it imports nothing of canzona_ds but itself and the ``flops`` leaf
  (not placement/, tp/, planning/, integration/, parallel, the orchestrator ``optimizer.py``
  or the user config ``config.py``, which sit above it);
* ``planning/`` is the bottom: itself and the ``flops`` leaf only;
* ``optim/``, ``placement/``, ``tp/``, ``planning/`` and ``parallel.py`` never import DeepSpeed;
* the main job sits on top: nothing of the library imports ``train/``, ``cli/``, ``data/`` or the
  job's model (``models/qwen3*``); the one module of ``models/`` the library uses is
  ``qk_record`` (QK-clip's instrumentation of any model's attention, integration/builder.py).

And one rule of the tests' own code, read the same way: a bit-for-bit comparison of floats goes
through what .ci/kernels' recorder sees (``escaping_exact_forms``; docs/exactness_audit.md)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "canzona_ds"


def _module_name(path: Path, pkg: Path = PKG) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_statements(path: Path, pkg: Path = PKG):
    """(module, imported names) of every import statement in ``path``, anywhere in the file,
    relative ones resolved to absolute names (``import a.b``: ``("a.b", [])``)."""
    name = _module_name(path, pkg)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = package.split(".")
                module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            yield module, [alias.name for alias in node.names]


def imports_of(path: Path, pkg: Path = PKG) -> set[str]:
    """Every module ``path`` imports (``from a import b`` gives ``a`` and ``a.b``), absolute names."""
    found: set[str] = set()
    for module, names in _import_statements(path, pkg):
        found.add(module)
        found.update(f"{module}.{n}" for n in names)
    return found


def _files(room: str) -> list[Path]:
    return sorted((PKG / room).rglob("*.py")) if (PKG / room).is_dir() else [PKG / f"{room}.py"]


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _own_modules() -> set[str]:
    """canzona_ds's modules and packages (``from canzona_ds.optim import rule`` names one)."""
    return {_module_name(p) for p in PKG.rglob("*.py")}


@pytest.mark.parametrize("room,allowed", [
    ("optim", ("canzona_ds.optim", "canzona_ds.flops")),
    ("planning", ("canzona_ds.planning", "canzona_ds.flops")),
])
def test_room_imports_only_below_it(room: str, allowed: tuple[str, ...]) -> None:
    own = _own_modules()
    bad = sorted(f"{path.relative_to(PKG)}: {name}" for path in _files(room) for name in imports_of(path)
                 if name in own and name != "canzona_ds" and not _inside(name, allowed))
    assert not bad, f"canzona_ds/{room}/ imports above itself:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", ["optim", "placement", "tp", "planning", "parallel"])
def test_no_deepspeed_outside_integration(room: str) -> None:
    bad = sorted(f"{path.relative_to(PKG)}: {name}" for path in _files(room) for name in imports_of(path)
                 if _inside(name, ("deepspeed",)))
    assert not bad, "\n".join(bad)


def test_main_job_sits_on_top() -> None:
    job = ("canzona_ds.train", "canzona_ds.cli", "canzona_ds.data", "canzona_ds.models")
    own = _own_modules()
    bad = sorted(f"{path.relative_to(PKG)}: {name}" for path in sorted(PKG.rglob("*.py"))
                 if not _inside(_module_name(path), job) for name in imports_of(path)
                 if name in own and _inside(name, job) and name != "canzona_ds.models.qk_record")
    assert not bad, "the library imports the main job:\n" + "\n".join(bad)


def test_the_check_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    """The reader itself: lazy relative imports are resolved to their absolute names."""
    probe = tmp_path / "canzona_ds" / "optim" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from ..placement import HostedSet\n    from . import rule\n    import deepspeed.moe\n")
    assert imports_of(probe, tmp_path / "canzona_ds") == {
        "canzona_ds.placement", "canzona_ds.placement.HostedSet", "canzona_ds.optim", "canzona_ds.optim.rule",
        "deepspeed.moe"}


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """canzona_ds's modules -> the canzona_ds modules each imports (any statement, module level or
    inside a function, relative ones resolved): ``from a import b`` is an arrow to ``a.b`` where
    that is a module, else to ``a``; ``import a.b`` an arrow to ``a.b`` (a parent package's
    ``__init__``, run first by Python, is not counted as an arrow)."""
    own = {_module_name(p, pkg) for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(pkg.rglob("*.py")):
        name = _module_name(path, pkg)
        arrows: set[str] = set()
        for module, names in _import_statements(path, pkg):
            if not names:
                arrows.add(module)
            arrows.update(f"{module}.{n}" if f"{module}.{n}" in own else module for n in names)
        graph[name] = {m for m in arrows if m in own and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) through each strongly connected group of modules that
    import each other (Tarjan's algorithm, then a shortest way back to its first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        start, members = group[0], set(group)
        back = {start: None}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in back:
                        back[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while back[path[-1]] is not None:
            path.append(back[path[-1]])
        cycles.append(path[::-1] + [start])
    return cycles


def test_no_import_cycles() -> None:
    """No two modules of canzona_ds import each other, directly or round a circle, lazily or not:
    what is shared lives in the module that owns it."""
    cycles = import_cycles(import_graph())
    assert not cycles, f"{len(cycles)} import circle(s) in canzona_ds:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_lazy_circle(tmp_path: Path) -> None:
    """The check itself: a circle closed by a function-local relative import is found."""
    pkg = tmp_path / "canzona_ds"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from .y import f\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from . import x\n")
    (pkg / "b.py").write_text("from .a import x\n")
    cycles = import_cycles(import_graph(pkg))
    assert [sorted(c[:-1]) for c in cycles] == [["canzona_ds.a.x", "canzona_ds.a.y"]], cycles


# ------------------------------------------------------------------ bit-for-bit assertions
#: where tests and their kit live; kernels.py itself implements the one way (assert_bits)
TEST_CODE = (PKG.parent / "tests", PKG.parent / "canzona_testkit")
KERNELS = PKG.parent / "canzona_testkit" / "kernels.py"
#: names whose values are floats when a test compares them (losses, differences)
FLOAT_NAMES = ("loss", "diff")


def _terminal_name(node: ast.AST) -> str:
    """The name a value is read by: ``x``, ``r.x``, ``r["x"]``, ``f(...)`` give ``x``/``f``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else _terminal_name(node.value)
    if isinstance(node, ast.Call):
        return _terminal_name(node.func)
    return ""


def _is_eq(node: ast.AST) -> bool:
    return isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)


def escaping_exact_forms(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, form) of every bit-for-bit comparison written so that .ci/kernels' recorder
    (canzona_testkit/kernels.py) cannot see it: ``np.array_equal``, ``(a == b).all()`` and
    ``all(a == b)``, ``==``/``!=`` on a ``.tolist()``, on a float literal (``d == 0.0`` on a
    difference included) or on a loss or a difference read by name.  ``assert_bits`` (or
    ``torch.equal`` and the zero-tolerance primitives, which the recorder wraps) says the same
    and enrolls the test."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("array_equal", "array_equiv"):
                found.append((node.lineno, f"np.{func.attr}"))
            elif isinstance(func, ast.Attribute) and func.attr == "all" and _is_eq(func.value):
                found.append((node.lineno, "(a == b).all()"))
            elif _terminal_name(func) == "all" and node.args and _is_eq(node.args[0]):
                found.append((node.lineno, "all(a == b)"))
        elif _is_eq(node):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Call) and _terminal_name(s) == "tolist" for s in sides):
                found.append((node.lineno, ".tolist() =="))
            elif any(isinstance(s, ast.Constant) and isinstance(s.value, float) for s in sides):
                found.append((node.lineno, "== on a float literal"))
            elif any(word in _terminal_name(s).lower() for s in sides for word in FLOAT_NAMES):
                found.append((node.lineno, "== on a loss or a difference"))
    return sorted(found)


def test_every_bit_for_bit_assertion_goes_through_the_recorder() -> None:
    """A float equality the recorder cannot see is a promise .ci/kernels never reruns (issue 46):
    the suite writes it ``assert_bits(a, b)``."""
    bad = []
    for root in TEST_CODE:
        for path in sorted(root.rglob("*.py")):
            if path != KERNELS:
                bad += [f"{path.relative_to(PKG.parent)}:{line}: {form}"
                        for line, form in escaping_exact_forms(path.read_text(), str(path))]
    assert not bad, "write these with canzona_testkit.kernels.assert_bits:\n" + "\n".join(bad)


def test_the_exact_form_check_sees_every_form() -> None:
    source = "\n".join([
        "assert np.array_equal(a, b)",
        "assert numpy.array_equiv(a, b)",
        "assert (a == b).all()",
        "assert bool(torch.all(a == b))",
        "assert x.tolist() == [1.5]",
        "assert r['replay'] == 0.0",
        "bad = {n: d for n, d in diffs.items() if d != 0.0}",
        "assert r['losses'] == ref['losses']",
        "assert max_diff == d",
        "assert_bits(a, b)",
        "assert torch.equal(a, b)",
        "assert names == ['w'] and n == 3",
    ])
    assert [line for line, _ in escaping_exact_forms(source)] == [1, 2, 3, 4, 5, 6, 7, 8, 9]



# ------------------------------------------------------------------ what a test file costs
TESTS = PKG.parent / "tests"
def starts_processes(source: str) -> bool:
    """The file calls ``run_distributed`` (ranks) or ``subprocess.*`` (the ``deepspeed`` launcher, a script)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "run_distributed":
                return True
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "subprocess":
                return True
    return False


def cost_problems(path: Path) -> list[str]:
    """A test file that starts processes states what it costs in its docstring (a ``Cost:``
    line: its rank runs or launching tests and its time as the profile measured it, docs/ci.md),
    so a reader sees it and a new file thinks about it before it adds minutes to every CI run."""
    text = path.read_text()
    if not starts_processes(text):
        return []
    doc = ast.get_docstring(ast.parse(text)) or ""
    if any(line.startswith("Cost:") for line in doc.splitlines()):
        return []
    return [f"{path.name}: starts processes but its docstring states no 'Cost:' line"]


def test_a_test_file_that_starts_processes_states_its_cost(tmp_path: Path) -> None:
    bad = [p for path in sorted(TESTS.glob("test_*.py")) for p in cost_problems(path)]
    assert not bad, "\n".join(bad) + "\n(docs/ci.md: how to measure a test file's cost)"
    quiet = tmp_path / "test_quiet.py"
    quiet.write_text('"""Pure logic."""\ndef test_x():\n    assert 1\n')
    loud = tmp_path / "test_loud.py"
    loud.write_text('"""Ranks."""\nfrom canzona_testkit.dist import run_distributed\nrun_distributed(f, 2)\n')
    assert starts_processes("subprocess.run(['deepspeed'])") and not starts_processes("x = 'run_distributed('")
    assert cost_problems(quiet) == [] and cost_problems(loud) == ["test_loud.py: starts processes but its "
                                                                  "docstring states no 'Cost:' line"]
