"""mlac's import graph has no cycles: between subpackages, and between modules at import time.

The graph is read from the source with `ast`, not by importing: every `mlac/**/*.py` found by
walking the tree (new modules and packages are covered without a list to update).

- Subpackage level: every import counts, those inside functions too (a lazy import is still a
  dependency); only imports under `if TYPE_CHECKING:` are left out. Modules collapse to the
  package that holds them (`mlac.compiler`, `mlac.runtime.serve`, ...); top-level modules
  (`mlac.cli`, `mlac.core.fp8`) stand for themselves.
- Module level: imports that run when the module is imported (not those inside functions),
  module by module.
- Annotations too: the module graph with the `if TYPE_CHECKING:` imports counted has no cycle
  either (a module that types against one above it takes a Protocol of its own instead).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import mlac

ROOT = Path(mlac.__file__).resolve().parent
Graph = dict[str, set[str]]
Where = dict[tuple[str, str], list[str]]  # (from, to) -> "path:line" of the imports behind the edge


# ---- reading the graph ------------------------------------------------------------------------


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package directory `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    node: ast.AST, module_level_only: bool, annotations: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, but those under `if TYPE_CHECKING:` (unless
    annotations) and, when module_level_only, those inside functions (which run only when called)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child) and not annotations:
            for c in child.orelse:
                yield from _imports(ast.Module(body=[c], type_ignores=[]), module_level_only)
        elif not (module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))):
            yield from _imports(child, module_level_only, annotations)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The known modules an import statement loads (`from pkg import mod` loads pkg.mod)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:  # `import mlac.x.y` of a non-module attribute: its module
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph(root: Path, module_level_only: bool, annotations: bool = False) -> tuple[Graph, Where]:
    """Module -> the modules of the same package tree that it imports (with the `if TYPE_CHECKING:`
    imports when annotations)."""
    files = module_files(root)
    known = set(files)
    graph: Graph = {m: set() for m in files}
    where: Where = defaultdict(list)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree, module_level_only, annotations):
            for target in _targets(node, module, path.name == "__init__.py", known) - {module}:
                graph[module].add(target)
                where[module, target].append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph, where


def packages(root: Path) -> set[str]:
    return {m for m, p in module_files(root).items() if p.name == "__init__.py"}


def siblings(graph: Graph, where: Where) -> tuple[Graph, Where]:
    """Each edge m -> t becomes x -> y, x and y the children of m's and t's nearest common package
    that hold them (an import of an enclosing package's own __init__ is left out)."""
    out: Graph = defaultdict(set)
    out_where: Where = defaultdict(list)
    for m, targets in graph.items():
        for t in targets:
            pm, pt = m.split("."), t.split(".")
            i = 0
            while i < min(len(pm), len(pt)) and pm[i] == pt[i]:
                i += 1
            if i >= len(pm) or i >= len(pt):
                continue  # one holds the other
            a, b = ".".join(pm[: i + 1]), ".".join(pt[: i + 1])
            out[a].add(b)
            out.setdefault(b, set())
            out_where[a, b] += where[m, t]
    return dict(out), out_where


def collapse(graph: Graph, where: Where, pkgs: set[str], top: str) -> tuple[Graph, Where]:
    """Each module -> the innermost package holding it (a top-level module stands for itself)."""

    def node(m: str) -> str:
        if m in pkgs:
            return m
        parent = m.rpartition(".")[0]
        return m if parent == top else node(parent)

    out: Graph = defaultdict(set)
    out_where: Where = defaultdict(list)
    for m, targets in graph.items():
        out.setdefault(node(m), set())
        for t in targets:
            a, b = node(m), node(t)
            if a != b:
                out[a].add(b)
                out_where[a, b] += where[m, t]
    return dict(out), out_where


# ---- finding cycles ---------------------------------------------------------------------------


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; every node appears once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return out


def a_cycle(graph: Graph, component: list[str]) -> list[str]:
    """One cycle through the component's first node: [a, b, ..., a] (breadth-first, shortest)."""
    first, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(parent[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def cycles(graph: Graph, where: Where) -> list[str]:
    """A readable line per cycle: the modules in order, and the imports behind each edge."""
    out = []
    for comp in strongly_connected(graph):
        if len(comp) > 1:
            path = a_cycle(graph, comp)
            edges = "; ".join(
                f"{a} -> {b} at {', '.join(where[a, b][:3])}" for a, b in zip(path, path[1:], strict=False)
            )
            out.append(f"cycle {' -> '.join(path)} (component {comp}): {edges}")
    return out


# ---- the finder on graphs it must catch -------------------------------------------------------


def test_finder_names_a_cycle_in_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert strongly_connected(graph) == [["d"], ["a", "b", "c"], ["e"]]
    where = defaultdict(list, {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3"]})
    (line,) = cycles(graph, where)
    assert line.startswith("cycle a -> b -> c -> a ") and "c -> a at c.py:3" in line
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}, defaultdict(list)) == []
    assert cycles({"a": {"b"}, "b": {"a"}}, defaultdict(list))[0].startswith("cycle a -> b -> a ")


def test_reader_sees_lazy_relative_and_from_package_imports(tmp_path):
    """A cycle closed only by a function-level import, a relative import or `from pkg import mod`
    is found at the subpackage level; `if TYPE_CHECKING:` imports and function-level imports are
    left out of the module level; `if TYPE_CHECKING:` imports count with annotations."""
    pkg = tmp_path / "toy"
    files = {
        "__init__.py": "",
        "leaf.py": "import os\n",
        "a/__init__.py": "",
        "a/x.py": "from toy.b import y\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from ..a import x\n",
        "c/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import toy.a.x\n",
        "d/__init__.py": "from toy import leaf\nfrom toy.c import nothing_here\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph, where = import_graph(pkg, module_level_only=False)
    assert graph["toy.b.y"] == {"toy.a.x"} and graph["toy.c"] == set()
    assert graph["toy.d"] == {"toy.leaf", "toy.c"}
    sub, sub_where = collapse(graph, where, packages(pkg), "toy")
    assert sub["toy.d"] == {"toy.leaf", "toy.c"}
    (line,) = cycles(sub, sub_where)
    assert line.startswith("cycle toy.a -> toy.b -> toy.a ") and "toy/b/y.py:2" in line
    module_graph, module_where = import_graph(pkg, module_level_only=True)
    assert module_graph["toy.b.y"] == set() and cycles(module_graph, module_where) == []
    typed, _ = import_graph(pkg, module_level_only=False, annotations=True)
    assert typed["toy.c"] == {"toy.a.x"}


# ---- mlac itself ------------------------------------------------------------------------------

# Top-level packages from the bottom up: each may import only those before it.
LAYERS = (
    ("mlac.core",),
    ("mlac.settings",),
    ("mlac.kernels", "mlac.passes"),
    ("mlac.runtime",),
    ("mlac.compiler", "mlac.export", "mlac.synth", "mlac.ship"),
    ("mlac.tools",),
    ("mlac.cli",),
)


def layer_of(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def upward_imports(graph: Graph, where: Where) -> list[str]:
    """Imports from a module to one of a layer above its own (or of its own layer, another package)."""
    bad = []
    for m, targets in graph.items():
        lm = layer_of(m)
        for t in targets:
            lt = layer_of(t)
            top_m, top_t = ".".join(m.split(".")[:2]), ".".join(t.split(".")[:2])
            if lm is not None and lt is not None and (lt > lm or (lt == lm and top_m != top_t)):
                bad.append(f"{m} -> {t} at {where[m, t]}")
    return bad


def test_no_cycle_between_modules():
    graph, where = import_graph(ROOT, module_level_only=False)
    assert "mlac.passes.fuse" in graph["mlac.compiler.pipeline"]  # the reader sees real edges
    assert cycles(graph, where) == []


def test_no_cycle_between_modules_at_import_time():
    graph, where = import_graph(ROOT, module_level_only=True)
    assert cycles(graph, where) == []


def test_no_cycle_between_modules_counting_annotations():
    """An import for annotations only still ties a module to the one it names: the overlap fliers
    type against overlap.SchedulerView and spec/overlap.Speculator, not the classes that own them."""
    graph, where = import_graph(ROOT, module_level_only=False, annotations=True)
    assert "mlac.runtime.engine.sequence" in graph["mlac.runtime.engine.overlap"]  # a TYPE_CHECKING import
    assert cycles(graph, where) == []


def test_no_cycle_between_sibling_packages():
    graph, where = import_graph(ROOT, module_level_only=False)
    sib, sib_where = siblings(graph, where)
    assert "mlac.runtime.kvcache" in sib["mlac.runtime.engine"]
    assert cycles(sib, sib_where) == []


def test_every_top_level_package_has_a_layer_and_imports_point_down():
    graph, where = import_graph(ROOT, module_level_only=False)
    tops = {".".join(m.split(".")[:2]) for m in graph if m != "mlac"}
    assert [t for t in sorted(tops) if layer_of(t) is None] == []
    assert upward_imports(graph, where) == []


def test_a_planted_circle_in_mlac_is_found(tmp_path):
    """A copy of mlac with one lazy import added (core/errors.py importing the engine inside a
    function) fails the module-level check, the sibling check and the layer check."""
    import shutil

    copy = tmp_path / "mlac"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    errors = copy / "core" / "errors.py"
    errors.write_text(
        errors.read_text() + "\n\ndef _planted():\n    from mlac.runtime.engine import engine\n"
    )
    graph, where = import_graph(copy, module_level_only=False)
    (line,) = [c for c in cycles(graph, where) if "mlac.core.errors" in c]
    assert "mlac.core.errors -> mlac.runtime.engine.engine at mlac/core/errors.py:" in line
    sib, sib_where = siblings(graph, where)
    assert any("mlac.core -> mlac.runtime" in c for c in cycles(sib, sib_where))
    assert any(
        b.startswith("mlac.core.errors -> mlac.runtime.engine.engine") for b in upward_imports(graph, where)
    )
    assert cycles(*import_graph(copy, module_level_only=True)) == []  # lazy: not at import time


def test_core_is_a_leaf_and_kernels_stay_below_the_runtime():
    graph, where = import_graph(ROOT, module_level_only=False)
    assert graph["mlac.core.lazy"] <= {"mlac.core.errors"}, graph["mlac.core.lazy"]
    assert graph["mlac.core.fp8"] <= {"mlac.core.errors", "mlac.core.lazy"}, graph["mlac.core.fp8"]
    below = ("mlac.passes", "mlac.compiler", "mlac.runtime", "mlac.synth")
    bad = [
        f"{m} -> {t} at {where[m, t]}"
        for m, targets in graph.items()
        if m.startswith("mlac.kernels")
        for t in targets
        if t.startswith(below)
    ]
    assert bad == []
