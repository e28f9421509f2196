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
