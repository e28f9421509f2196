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


def imported_modules(path: Path, root: Path = SRC) -> set[str]:
    """The fedmosaic modules (dotted, ``fedmosaic.`` dropped) a file imports anywhere in it, lazy imports included
    (``from ..engine import robust`` counts as ``engine.robust``)."""
    package = list(path.relative_to(root).parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("fedmosaic."):
                parts = node.module.split(".")[1:]
            else:
                continue
            found |= {".".join(parts + [a.name]) for a in node.names} | {".".join(parts)}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("fedmosaic.")}
    return found


#: folder -> the folders (and modules) no file in it may import, even lazily: data flows config -> setup (a world,
#: built once) -> engine runtimes -> rounds -> runs (records); the client and the server side share only what lies
#: below both (group, messages, seeding, tensors, mapping, evaluate, robust, stopping)
FOLDER_RULES = {
    "engine": ("setup", "runs", "cli", "api", "deploy", "reports"),
    "engine/client": ("engine.server", "engine.pools", "engine.federation", "engine.evaluation", "engine.state"),
    "engine/server": ("engine.client", "engine.pools", "engine.federation", "engine.evaluation", "engine.state"),
    "engine/pools": ("engine.server", "engine.federation", "engine.evaluation", "engine.state"),
    "setup": ("runs", "cli", "api", "deploy", "reports"),
    "runs": ("cli", "api", "deploy", "reports"),
}


def breaks(folder: str, root: Path = SRC) -> list[str]:
    banned = FOLDER_RULES[folder]
    return sorted(f"{p.relative_to(root)} imports {m}" for p in (root / folder).rglob("*.py")
                  for m in imported_modules(p, root) if any(m == b or m.startswith(b + ".") for b in banned))


@pytest.mark.parametrize("folder", sorted(FOLDER_RULES))
def test_each_folder_imports_only_what_lies_below_it(folder):
    assert breaks(folder) == []


def test_the_folder_scan_sees_a_lazy_upward_import(tmp_path):
    (tmp_path / "engine" / "client").mkdir(parents=True)
    (tmp_path / "engine" / "client" / "m.py").write_text("def f():\n    from ...setup.world import build\n"
                                                         "from ..server import runtime\n")
    assert breaks("engine", tmp_path) == ["engine/client/m.py imports setup.world",
                                          "engine/client/m.py imports setup.world.build"]
    assert breaks("engine/client", tmp_path) == ["engine/client/m.py imports engine.server",
                                                 "engine/client/m.py imports engine.server.runtime"]


def whole_config_uses(path: Path) -> list[str]:
    """Where an engine file could take the whole ``RunConfig``: the name itself, a parameter ``cfg`` that is not one
    section's type, or a ``.cfg`` read off anything but an algorithm (``algo.cfg``: the algorithm's own options)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id == "RunConfig" or isinstance(node, ast.alias) and \
                node.name == "RunConfig":
            found.append(f"{path.name}:{node.lineno} names RunConfig")
        elif isinstance(node, ast.arg) and node.arg == "cfg" and not (
                isinstance(node.annotation, ast.Name) and node.annotation.id.endswith("Config")
                and node.annotation.id != "RunConfig"):
            found.append(f"{path.name}:{node.lineno} takes a cfg")
        elif isinstance(node, ast.Attribute) and node.attr == "cfg" and not (
                isinstance(node.value, ast.Name) and node.value.id == "algo"
                or isinstance(node.value, ast.Attribute) and node.value.attr == "algo"):
            found.append(f"{path.name}:{node.lineno} reads .cfg")
    return sorted(found, key=lambda s: int(s.split(":")[1].split()[0]))


def test_no_engine_file_takes_the_whole_run_config():
    """Only ``setup`` (and the layers above it) reads the ``RunConfig``; the runtimes get ``RoundSettings`` and
    values."""
    assert [u for p in sorted((SRC / "engine").rglob("*.py")) for u in whole_config_uses(p)] == []


def test_the_config_scan_sees_each_way_in(tmp_path):
    (tmp_path / "m.py").write_text("def f(cfg, opt: OptimizerConfig):\n    return cfg.train\n"
                                   "def g(cfg: OptimizerConfig, x):\n    return x.cfg.seed, self.algo.cfg, algo.cfg\n"
                                   "from fedmosaic.config import RunConfig\n")
    assert whole_config_uses(tmp_path / "m.py") == ["m.py:1 takes a cfg", "m.py:4 reads .cfg",
                                                    "m.py:5 names RunConfig"]


def test_no_runtime_built_for_a_run_holds_its_config():
    """Walked from the server runtime, the client runtimes (in-process and wire), their trainers and the pools:
    no ``RunConfig`` is reachable — what a runtime knows of the run is its ``RoundSettings`` and values."""
    from fedtest import BLOBS6, CONTINUAL, merged, with_overrides

    from fedmosaic.config import RunConfig
    from fedmosaic.setup.world import build_federation

    def holds_config(root) -> list[str]:
        seen, todo, found = set(), [(root, "root")], []
        while todo:
            obj, where = todo.pop()
            if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
                continue
            seen.add(id(obj))
            if isinstance(obj, RunConfig):
                found.append(where)
                continue
            if isinstance(obj, dict):
                todo += [(v, f"{where}[{k!r}]") for k, v in obj.items()]
            elif isinstance(obj, (list, tuple, set)):
                todo += [(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            elif type(obj).__module__.startswith("fedmosaic.") and hasattr(obj, "__dict__"):
                todo += [(v, f"{where}.{k}") for k, v in vars(obj).items()]
            elif callable(obj) and getattr(obj, "__closure__", None):  # a lambda or partial over the config
                todo += [(c.cell_contents, f"{where}<closure>") for c in obj.__closure__]
        return found

    for raw, pool in ((merged(BLOBS6, {"algorithm": {"name": "ditto"}}), "local"),
                      (merged(BLOBS6, CONTINUAL) | {"algorithm": {"name": "protofcl"}}, "wire")):
        fed = build_federation(with_overrides(raw), pool=pool)
        fed.round(0)  # (a wire pool's runtimes exist while their clients have messages)
        roots = {"srv": fed.srv, "runtime": fed.runtime, "pool": fed.pool}
        if pool == "wire":
            roots["a wire runtime"] = fed.pool.runtime(0)
        assert {k: holds_config(v) for k, v in roots.items()} == {k: [] for k in roots}
        # and the scan does find a config where one is kept
        fed.runtime.stray = {"x": [fed.world.cfg]}
        assert holds_config(fed.runtime) == ["root.stray['x'][0]"]


def test_engine_files_stay_small_and_the_driver_smaller():
    """A file of the engine does one job (under 350 lines); ``Federation`` drives rounds and nothing else (under
    250): a builder, a format or an evaluator growing back into either fails here."""
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in (SRC / "engine").rglob("*.py")}
    assert {f: n for f, n in sizes.items() if n >= 350} == {}
    (cls,) = [n for n in ast.parse((SRC / "engine" / "federation.py").read_text()).body
              if isinstance(n, ast.ClassDef) and n.name == "Federation"]
    assert cls.end_lineno - cls.lineno + 1 < 250


def test_nothing_imports_a_name_from_the_package_root():
    """The package root only re-exports the API lazily; modules take what they need from where it lives (the
    version from ``version.py``), never from the root above them."""
    bad = []
    for p in SRC.rglob("*.py"):
        package = list(p.relative_to(SRC).parts[:-1])
        for node in ast.walk(ast.parse(p.read_text())):
            root = node.level == len(package) + 1 and not node.module if isinstance(node, ast.ImportFrom) else False
            root = root or isinstance(node, ast.ImportFrom) and node.module == "fedmosaic"
            if root:
                bad += [f"{p.relative_to(SRC)}: {a.name}" for a in node.names
                        if not ((SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file())]
    assert bad == []
