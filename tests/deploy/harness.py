"""A real Flower federation on loopback for the tests: a SuperLink with TLS and node authentication, SuperNodes
with registered keys, ``flwr run`` and the run's status. Every process runs in its own session and is stopped by
its process group when the federation closes, also when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def patient(seconds: float) -> float:
    """``seconds`` stretched by how busy this machine is now (its 1-minute load per core, from 1x up to 6x): a
    deadline that a quiet machine meets easily and a loaded one (four test workers, a Flower ClientApp process per
    message) still meets."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return round(seconds * min(6.0, max(1.0, load)), 1)


def write_home(home: Path, address: str, ca: Path) -> None:
    """A flwr CLI home whose connection ``fedmosaic`` is ``address`` trusting ``ca``."""
    import tomli_w

    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(tomli_w.dumps(
        {"superlink": {"default": "fedmosaic", "fedmosaic": {"address": address, "root-certificates": str(ca)}}}))


def exe(name: str) -> str:
    """A Flower command of this Python's environment (where pip put it), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


class LocalFederation:
    """A SuperLink on 127.0.0.1 with the PKI in ``pki`` (``deploy.prepare.make_pki``) behind the fleet gateway, as
    ``fedmosaic deploy`` sets them up: the SuperLink on ``link_port`` (the operator's flwr CLI, home in ``home``),
    the gateway on ``port`` (the SuperNodes); logs in ``logs``."""

    def __init__(self, root: Path, pki: Path, data_dir: str):
        self.root, self.pki, self.data_dir = Path(root), Path(pki), data_dir
        self.port, self.link_port = free_port(), free_port()
        self.home = self.root / "flwr"
        self.home.mkdir(parents=True, exist_ok=True)
        write_home(self.home, f"127.0.0.1:{self.link_port}", self.pki / "ca.crt")
        self.env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_HOME": str(self.home), "FEDMOSAIC_DATA": data_dir, "OMP_NUM_THREADS": "1",
                    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}  # fewer idle seconds per message
        self.keys = self.root / "node_keys.json"  # the gateway's allow-list: every key registered here
        self.keys.write_text("{}")
        self.procs: dict[str, subprocess.Popen] = {}
        self.offsets: dict[str, int] = {}
        (self.root / "logs").mkdir(exist_ok=True)

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / "logs" / f"{name}.log", "ab")
        self.offsets[name] = log.tell()  # (a restarted process appends: what it logs starts here)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                             cwd=self.root)
        log.close()
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.root / "logs" / f"{name}.log").read_text(errors="replace")

    def log_since_start(self, name: str) -> str:
        with open(self.root / "logs" / f"{name}.log", "rb") as f:
            f.seek(self.offsets.get(name, 0))
            return f.read().decode(errors="replace")

    def start_link(self, timeout: float = 60) -> None:
        p = self.pki
        self._start("superlink", [exe("flower-superlink"), "--ssl-ca-certfile", str(p / "ca.crt"),
                                  "--ssl-certfile", str(p / "server.pem"), "--ssl-keyfile", str(p / "server.key"),
                                  "--enable-supernode-auth", "--disable-runtime-dependency-installation",
                                  "--host", "127.0.0.1", "--port", str(self.link_port)])  # (in memory, as deploy's)
        self._up("superlink", self.link_port, "/health", timeout)
        self.start_gateway(timeout)

    def start_gateway(self, timeout: float = 60) -> None:
        p = self.pki
        self._start("gateway", [exe("fedmosaic"), "gateway", "--listen", f"127.0.0.1:{self.port}", "--superlink",
                                f"127.0.0.1:{self.link_port}", "--certfile", str(p / "server.pem"), "--keyfile",
                                str(p / "server.key"), "--ca", str(p / "ca.crt"), "--node-keys", str(self.keys)])
        self._up("gateway", self.port, "/v1/fleet/get-run", timeout)

    def _up(self, name: str, port: int, path: str, timeout: float) -> None:
        """Wait until ``name`` answers HTTPS on ``port`` (any status: the gateway refuses a GET, by design)."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx, timeout=2):
                    return
            except urllib.error.HTTPError:
                return
            except OSError:
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {name} did not come up:\n" + self.log(name)[-3000:]) from None
                time.sleep(0.3)

    def flwr(self, *args: str, timeout: float = 120, home: Path | None = None) -> subprocess.CompletedProcess:
        env = self.env if home is None else {**self.env, "FLWR_HOME": str(home)}
        return subprocess.run([exe("flwr"), *args], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=self.root)

    def register(self, pub: Path) -> int:
        from fedmosaic.deploy.prepare import public_key_pem
        from fedmosaic.files import atomic_write

        keys = json.loads(self.keys.read_text())
        atomic_write(self.keys, json.dumps({**keys, str(pub): public_key_pem(pub)}).encode())
        r = self.flwr("supernode", "register", str(pub), "fedmosaic", "--format", "json")
        out = json.loads(r.stdout)
        if not out.get("success"):
            raise RuntimeError(f"register {pub}: {r.stdout} {r.stderr}")
        return int(out["node-id"])

    def start_node(self, name: str, key: Path, node_config: str, extra: list[str] = ()) -> subprocess.Popen:
        return self._start(name, [exe("flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
                                  "--root-certificates", str(self.pki / "ca.crt"),
                                  "--auth-supernode-private-key", str(key), "--port", str(free_port()),
                                  "--node-config", node_config, *extra])

    def wait_online(self, n: int, timeout: float = 60) -> None:
        """Until ``n`` of the SuperNodes started here have logged their node id since they started: Flower logs it
        once the SuperLink (through the gateway) has activated the node. (Read from their logs: asking the
        SuperLink is a `flwr` process, about a second of CPU, per look.)"""
        deadline = time.monotonic() + timeout
        nodes = [k for k in self.procs if k.startswith("node")]
        while time.monotonic() < deadline:
            if sum("SuperNode ID:" in self.log_since_start(k) for k in nodes) >= n:
                return
            time.sleep(0.3)
        raise RuntimeError(f"fewer than {n} SuperNodes online within {timeout} s: " +
                           " | ".join(f"{k}: {self.log_since_start(k)[-300:]}" for k in nodes))

    def submit(self, app: Path, run_config: str | None = None) -> int:
        args = ["run", str(app), "fedmosaic", "--format", "json"]
        if run_config:
            args += ["--run-config", run_config]
        r = self.flwr(*args)
        try:
            return int(json.loads(r.stdout)["run-id"])
        except (ValueError, KeyError):
            raise RuntimeError(f"flwr run failed: {r.stdout} {r.stderr}") from None

    def status(self, run_id: int) -> dict:
        r = self.flwr("ls", "fedmosaic", "--run-id", str(run_id), "--format", "json")
        return json.loads(r.stdout)["runs"][0]

    def wait(self, run_id: int, timeout: float = 300, done: Path | None = None) -> dict:
        """The run's status once finished. Every look is a `flwr ls`, a Python process of its own (about a second of
        CPU, which a test polling every few seconds spent many times over while its run went on): when ``look_due``
        says (``done``: a run directory's summary.json, the ServerApp ending)."""
        deadline, looked, seen, st = time.monotonic() + timeout, time.monotonic(), False, {}
        while time.monotonic() < deadline:
            due, seen = self.look_due(looked, seen, done)
            if due:
                st, looked = self.status(run_id), time.monotonic()
                if str(st.get("status", "")).startswith("finished"):
                    return st
            time.sleep(0.25)
        raise TimeoutError(f"run {run_id} did not finish within {timeout} s: {st}")

    def look_due(self, looked: float, seen: bool, done: Path | None = None) -> tuple[bool, bool]:
        """Whether to ask Flower for the run's status now (the last look at ``looked``), and whether a ServerApp has
        been seen: never while the run's ServerApp process runs; 2 s after the last look once it has ended (or none
        runs and the file ``done`` is there); 30 s after it otherwise (a run refused before its ServerApp started)."""
        running = self.serverapps()
        seen = seen or running > 0
        ending = seen or (done is not None and done.exists())
        return not running and time.monotonic() - looked >= (2 if ending else 30), seen

    def serverapps(self) -> int:
        """How many ServerApp processes (`flwr-serverapp`, one a run, started by the SuperExec that the SuperLink
        starts in a session of its own) run below this federation's processes now, read from /proc (no process
        started to ask)."""
        from scale.raytools import descendants

        n = 0
        for pid in descendants(*(p.pid for p in self.procs.values())):
            with contextlib.suppress(OSError):
                n += b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes()
        return n

    def logs_of(self, run_id: int) -> str:
        return self.flwr("log", str(run_id), "fedmosaic", "--show").stdout

    def kill_all(self) -> None:
        """kill -9 of every process group started here (SuperLink with its ServerApp, gateway, SuperNodes), at once."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            p.wait(10)
        self.procs.clear()

    def stop(self, name: str | None = None) -> None:
        for key in [name] if name else list(self.procs):
            p = self.procs.pop(key, None)
            if p is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            # the SuperExec a SuperNode or SuperLink spawned is in the same session: stop what is left of it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


# Helpers of the tests that run deployments (test_flower*.py)

def start(root: Path, clients: int = 3, data: dict | None = None) -> LocalFederation:
    """A SuperLink and ``clients`` registered SuperNodes (``data[k]``: node k's data-dir), all online."""
    from conftest import DATA_PATH

    from fedmosaic.deploy.prepare import make_pki

    make_pki(root / "pki", ["127.0.0.1"], clients)
    fed = LocalFederation(root, root / "pki", os.environ.get("FEDMOSAIC_TEST_DATA", DATA_PATH))
    try:
        fed.start_link()
        for k in range(clients):
            fed.register(root / "pki" / f"node-{k}.pub")
            start_node(fed, k, (data or {}).get(k))
        fed.wait_online(clients)
    except BaseException:
        fed.stop()
        raise
    return fed


def start_node(fed: LocalFederation, k: int, data_dir: str | None = None):
    from fedmosaic.deploy.prepare import node_config

    return fed.start_node(f"node{k}", fed.pki / f"node-{k}", node_config(k, fed.root / "nodes", data_dir))


def deploy(cfg, where: Path, fed: LocalFederation) -> Path:
    """The app of ``cfg`` (its commands name other ports: the tests' federation has its own), its clients bound to
    the node keys of ``fed``'s PKI, as `fedmosaic deploy` binds them to the keys it makes."""
    from fedmosaic.deploy.prepare import NODE_KEYS, prepare, public_key_pem

    prepare(cfg, where, port=1, link_port=2, check=False)
    keys = {str(k): public_key_pem(fed.pki / f"node-{k}.pub") for k in range(cfg.data.clients)}
    (where / "app" / "fedmosaic_app" / NODE_KEYS).write_text(json.dumps(keys))
    return where / "app"


def finished(fed: LocalFederation, app: Path, run_config: str | None = None, timeout: float = 400) -> dict:
    st = fed.wait(fed.submit(app, run_config), timeout, done=app.parent / "run" / "summary.json")
    st["log"] = fed.logs_of(int(st["run-id"]))
    return st


def completed(fed, app, run_config=None) -> dict:
    st = finished(fed, app, run_config)
    assert st["status"] == "finished:completed", f"{st['status-details']}\n{st['log'][-4000:]}"
    return st


def kill_after_round_0(fed: LocalFederation, run_id: int, run_dir: Path, timeout: float = 300, kill=None) -> None:
    """Wait until round 0 of ``run_id`` is in ``run_dir``'s metrics, then ``kill()`` (default: stop node 2)."""
    from fedmosaic.runs.records import read_metrics

    deadline, looked, seen = time.monotonic() + timeout, time.monotonic(), False
    while not (run_dir / "metrics.jsonl").is_file() or not read_metrics(run_dir):
        assert time.monotonic() < deadline, "round 0 did not finish"
        due, seen = fed.look_due(looked, seen)
        if due:  # the run ended before its first round?
            st, looked = fed.status(run_id), time.monotonic()
            assert not st["status"].startswith("finished"), f"{st['status-details']}\n{fed.logs_of(run_id)[-3000:]}"
        time.sleep(0.2)
    kill() if kill else fed.stop("node2")
