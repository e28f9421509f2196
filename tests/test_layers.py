"""Imports point down only: ``protocol`` (what both sides of a round share) imports neither the algorithms nor the
engine; the algorithms import the protocol, never the engine; the engine imports the protocol, never an algorithm
(it finds them through the registry). A static scan of every import statement, so a violation fails here before it
becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fedmosaic"
#: package -> the sibling packages it must not import
FORBIDDEN = {"protocol": {"engine", "algorithms"}, "algorithms": {"engine"}, "engine": {"algorithms"}}


def imported_packages(path: Path, root: Path = SRC) -> set[str]:
    """The fedmosaic sub-packages a module imports (``from ..engine.x import y``, ``import fedmosaic.engine``)."""
    package = path.relative_to(root).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = list(package[: len(package) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts] if node.module else [base + [a.name] for a in node.names]
            else:
                names = [node.module.split(".")[1:]] if node.module and node.module.startswith("fedmosaic.") else []
            found |= {p[0] for p in names if p}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("fedmosaic.")}
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down_only(package):
    bad = {f"{p.relative_to(SRC)} imports {sorted(imported_packages(p) & FORBIDDEN[package])}"
           for p in (SRC / package).rglob("*.py") if imported_packages(p) & FORBIDDEN[package]}
    assert not bad, sorted(bad)


def test_the_scan_sees_relative_and_absolute_imports(tmp_path):
    (tmp_path / "engine").mkdir()
    mod = tmp_path / "engine" / "m.py"
    mod.write_text("from ..algorithms.terms import x\nfrom . import local\nimport fedmosaic.protocol.tree\n"
                   "from .. import data\nfrom fedmosaic.models import y\nimport torch\n")
    assert imported_packages(mod, tmp_path) == {"algorithms", "engine", "protocol", "data", "models"}


def test_client_hooks_never_take_the_servers_state():
    from fedmosaic.protocol.algorithm import CLIENT_HOOKS, Algorithm, register_algorithm, registered

    assert len(registered()) > 30  # every built-in algorithm was checked when it registered

    class Old(Algorithm):
        name = "old-style"

        def personal_params(self, state, server, own):
            return server["model"]

    with pytest.raises(TypeError, match=r"^algorithm 'old-style': the client hook personal_params takes the "
                                        r"server's state; .*: personal_params\(state, payload\)$"):
        register_algorithm(Old)
    assert "old-style" not in registered() and "probes" in CLIENT_HOOKS


def module_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Per fedmosaic module the fedmosaic modules its module-level imports load (``from ..x import y`` counts as
    ``x.y`` when that is a module, else ``x``; imports inside functions — lazy on purpose — do not count)."""
    mods = {}
    for p in root.rglob("*.py"):
        rel = p.relative_to(root.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    graph = {}
    for name, p in mods.items():
        pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                m = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                deps |= {f"{m}.{a.name}" if f"{m}.{a.name}" in mods else m for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other_at_load_time():
    assert cycles(module_graph()) == []


def test_the_cycle_scan_finds_a_cycle(tmp_path):
    pkg = tmp_path / "fedmosaic"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from . import b\n")
    (pkg / "engine" / "b.py").write_text("from .a import x\n\ndef f():\n    from . import c\n")
    (pkg / "engine" / "c.py").write_text("from .b import f\n")
    assert cycles(module_graph(pkg)) == [["fedmosaic.engine.a", "fedmosaic.engine.b"]]


def test_only_the_command_line_imports_the_command_line():
    """The Python API and the library below it stand on their own: nothing outside ``cli`` imports it."""
    bad = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if p.parent.name != "cli" and "cli" in imported_packages(p))
    assert not bad, bad
