"""The layer rules of docs ARCHITECTURE ("Layers", "Two seams"), read from the imports.

The package is parsed with `ast` (nothing is imported or run, so it takes well under a
second): every `import` / `from ... import` naming a `pivotrl_hpc` module, at module level,
inside a function or under TYPE_CHECKING alike, is an edge. Two rules:
- a package imports only packages on a lower floor of `FLOORS`, and `controller` / `sim`
  speak to workers only through the vocabulary (`SEAM`), never `runtime` or `engines`;
- no circle among modules, inside a package or across.
A broken rule fails naming each offending import as `file:line  from -> to`.

`KNOWN` lists the imports that break a rule today, each with why and who removes it; an
entry that no longer matches any import fails too, so the list only shrinks.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pivotrl_hpc"

# Top floor first; a package may import the packages on the floors below its own.
# ARCHITECTURE.md's order, with the packages it does not list placed by what they hold:
# reproduce drives simulations and runs (above sim and launch); sim drives the controller;
# report reads traces; trace writes its files through checkpoint's checked folders
# (checkpoint.folders), so it sits right above it; checkpoint holds run state the runtime
# saves; assets makes the CPU demo's models and data (its GenRM warm start uses the task's
# judge and rewards) above the RL task; protocol is the vocabulary below them all;
# config is the leaf, over only the registry of environment variables.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("reproduce",),
    ("launch",),
    ("sim",),
    ("controller",),
    ("report",),
    ("runtime",),
    ("trace",),
    ("checkpoint",),
    ("engines",),
    ("gps",),
    ("assets",),
    ("task",),
    ("plan",),
    ("sched",),
    ("protocol",),
    ("config",),
    ("envs",),   # the one registry of environment variables (pivotrl_hpc/envs.py)
    ("terminal",),   # text from data made safe for a terminal (pivotrl_hpc/terminal.py)
)
# The controller and the simulator's modeled worker speak the worker protocol: they reach
# workers through it, not through the worker's or the engines' own modules.
SEAM = {"controller": ("runtime", "engines"), "sim": ("runtime", "engines")}

# (importing file, imported module) -> why it is allowed for now. Shrinks; never grows.
KNOWN: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    file: str      # relative to the package folder
    line: int
    source: str    # importing module
    target: str    # imported module

    def __str__(self) -> str:
        return f"{PACKAGE}/{self.file}:{self.line}  {self.source} -> {self.target}"


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module `name` starts with (`a.b.func` -> `a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def edges(root: Path = ROOT / PACKAGE) -> tuple[list[Edge], set[str]]:
    """Every import of a project module by a project module, and the modules."""
    files = {_module_of(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    found: list[Edge] = []
    for module, path in files.items():
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(node, module, path.name == "__init__.py")
                # `from pkg import sub` imports the submodule pkg.sub
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name, modules)
                if target and target != module:
                    found.append(Edge(rel, node.lineno, module, target))
    return found, modules


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _floor(package: str) -> int:
    for i, floor in enumerate(FLOORS):
        if package in floor:
            return i
    raise AssertionError(f"package {package!r} is on no floor of tests/test_layers.py FLOORS; "
                         "place it (and say why in ARCHITECTURE.md)")


def broken_rules(found: list[Edge]) -> list[tuple[Edge, str]]:
    """Each import that breaks a layer rule, with the rule."""
    out = []
    for e in found:
        src, dst = _package(e.source), _package(e.target)
        if src is None or dst is None or src == dst:
            continue   # the package's own __init__ (its public face), or one package
        if _floor(dst) <= _floor(src):
            out.append((e, f"{src} may not import {dst} (not on a lower floor)"))
        elif dst in SEAM.get(src, ()):
            out.append((e, f"{src} reaches workers through the protocol, not {dst}"))
    return out


def circles(found: list[Edge], modules: set[str]) -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), each sorted; only groups of 2+."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in found:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:   # recursion depth is bounded by the module count (~250)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(group))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def _circle_edges(found: list[Edge], group: list[str]) -> list[Edge]:
    members = set(group)
    seen: dict[tuple[str, int, str], Edge] = {}
    for e in found:
        if e.source in members and e.target in members:
            seen.setdefault((e.file, e.line, e.target), e)
    return list(seen.values())


def _known(e: Edge) -> bool:
    return (e.file, e.target) in KNOWN


def test_every_package_is_placed():
    packages = {p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").is_file()}
    placed = {p for floor in FLOORS for p in floor}
    assert packages <= placed, f"not on a floor: {sorted(packages - placed)}"


def test_imports_point_down():
    found, _ = edges()
    bad = [f"{e}   [{why}]" for e, why in broken_rules(found) if not _known(e)]
    assert not bad, "imports that break the layer rules:\n" + "\n".join(bad)


def test_no_import_circle():
    found, modules = edges()
    kept = [e for e in found if not _known(e)]
    bad = [" <-> ".join(g) + ":\n" + "\n".join(f"    {e}" for e in _circle_edges(kept, g))
           for g in circles(kept, modules)]
    assert not bad, "import circles:\n" + "\n".join(bad)


def test_the_known_list_only_shrinks():
    """Each allowed exception still matches an import that breaks a rule; one that is fixed
    leaves the list (so a later regression is caught)."""
    found, modules = edges()
    breaking = {(e.file, e.target) for e, _ in broken_rules(found)}
    for g in circles(found, modules):
        breaking |= {(e.file, e.target) for e in _circle_edges(found, g)}
    stale = sorted(set(KNOWN) - breaking)
    assert not stale, f"fixed, remove from KNOWN: {stale}"


def test_the_checks_see_a_forbidden_import_and_a_circle(tmp_path):
    """Not vacuous: a package with an upward import and a circle is caught, by file:line."""
    pkg = tmp_path / PACKAGE
    for sub, text in {"__init__.py": "", "sched/__init__.py": "",
                      "sched/a.py": "import json\nfrom pivotrl_hpc.controller.loop import X\n",
                      "sched/b.py": "def f():\n    from pivotrl_hpc.sched import c\n",
                      "sched/c.py": "from . import b\n",
                      "controller/__init__.py": "", "controller/loop.py": "X = 1\n"}.items():
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    found, modules = edges(pkg)
    assert [str(e) for e, _ in broken_rules(found)] == [
        "pivotrl_hpc/sched/a.py:2  pivotrl_hpc.sched.a -> pivotrl_hpc.controller.loop"]
    assert circles(found, modules) == [["pivotrl_hpc.sched.b", "pivotrl_hpc.sched.c"]]
