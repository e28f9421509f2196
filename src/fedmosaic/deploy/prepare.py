"""``fedmosaic deploy``: everything a Flower federation of one config needs, in one new directory.

- ``app/``: the Flower app (``pyproject.toml`` declaring the run config keys; ``fedmosaic_app/`` with the ServerApp,
  the ClientApp, the run's resolved config ``run.yaml`` and ``node_keys.json``: which node key may host which
  client, checked by the ServerApp at first contact),
- ``pki/``: a certificate authority, the SuperLink's TLS certificate (for the addresses it is reached at, and the
  loopback) and key, and per client a SuperNode key pair (ECDSA P-384, OpenSSH format, as Flower's node
  authentication expects),
- ``flwr/config.toml``: the ``flwr`` CLI's connection to the SuperLink on the server's loopback (``FLWR_HOME``),
- ``commands.sh``: the commands, in order — the SuperLink on loopback (TLS, node authentication, no runtime
  installs), the fleet gateway on the address nodes reach (``deploy/gateway.py``), the nodes' keys registered, one
  SuperNode per client with its partition, the run, its status.

Every argument is checked before anything is written (host a hostname or IP, ports in range and distinct, the
config one a run accepts); values reach ``commands.sh`` through a shell quoter and the TOML files through a TOML
writer. Nothing that exists is overwritten: the directory must be new (or empty). Keys are written readable by their
owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import shlex
from pathlib import Path

from ..errors import FedMosaicError
from .common import check_deployable

#: what every command we generate runs with: no telemetry, no update check (offline nodes), the CLI's own home
ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
LINK = "fedmosaic"  # the SuperLink connection's name in flwr/config.toml


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(out: Path, hosts: list[str], nodes: int, days: int = 365) -> None:
    """A CA, a server certificate for ``hosts`` (IP addresses or DNS names) and ``nodes`` SuperNode key pairs. The
    certificate also names 127.0.0.1: the SuperLink listens there, behind the fleet gateway."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = {"not_valid_before": now - datetime.timedelta(minutes=5), "not_valid_after": now + datetime.timedelta(days)}

    def build(subject, issuer, key, **ext):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key)
             .serial_number(x509.random_serial_number()).not_valid_before(valid["not_valid_before"])
             .not_valid_after(valid["not_valid_after"]))
        for e, critical in ext.values():
            b = b.add_extension(e, critical=critical)
        return b

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = build(_name("fedmosaic deployment CA"), _name("fedmosaic deployment CA"), ca_key.public_key(),
               basic=(x509.BasicConstraints(ca=True, path_length=0), True),
               usage=(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                                    encipher_only=False, decipher_only=False), True)).sign(ca_key, hashes.SHA256())
    names = []
    for h in dict.fromkeys([*hosts, "127.0.0.1"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = build(_name(hosts[0]), ca.subject, key.public_key(),
                 san=(x509.SubjectAlternativeName(names), False),
                 basic=(x509.BasicConstraints(ca=False, path_length=None), True),
                 eku=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)).sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True, mode=0o700)  # the keys' folder: its owner's alone
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    (out / "ca.crt").write_bytes(ca.public_bytes(pem))
    private(out / "ca.key", ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    (out / "server.pem").write_bytes(cert.public_bytes(pem))
    private(out / "server.key", key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    for k in range(nodes):
        node_key(out / f"node-{k}")


def private(path: Path, data: bytes) -> None:
    """A private key's file, readable by its owner alone from its first byte (not chmod-ed after being written
    under the umask), and never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def gateway_limit_mb(max_reply_mb: float) -> int:
    """The largest request body the gateway lets a node send: a reply of ``deploy.max_reply_mb`` with its
    framing (Flower's objects and headers), so that no node makes it hold more."""
    return int(max_reply_mb * 1.25) + 8


def node_key(path: Path) -> None:
    """A SuperNode key pair: ``path`` (private, OpenSSH) and ``path.pub`` (what the SuperLink registers)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption()))
    path.with_name(path.name + ".pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")


SERVER = '''"""The ServerApp: fedmosaic's server runtime for the config beside this file."""
from pathlib import Path

from fedmosaic.deploy.server import server_app

app = server_app(Path(__file__).with_name("run.yaml"))
'''

CLIENT = '''"""The ClientApp: one fedmosaic client per SuperNode (--node-config 'partition-id=K'), for the config beside this
file."""
from pathlib import Path

from fedmosaic.deploy.node import client_app

app = client_app(Path(__file__).with_name("run.yaml"))
'''

#: the file beside run.yaml that binds each client to the public key of the node that may host it
NODE_KEYS = "node_keys.json"


def _toml(s: str) -> str:
    import tomli_w

    return tomli_w.dumps({"v": s})[4:].strip()


def node_config(client: int, state_dir: str | Path, data_dir: str | None = None) -> str:
    """A SuperNode's ``--node-config``: the client it hosts, where it keeps its state, where its data are."""
    out = f"partition-id={client} state-dir={_toml(str(state_dir))}"
    return out + (f" data-dir={_toml(data_dir)}" if data_dir else "")


_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def check_host(host: str, flag: str = "--host") -> str:
    """``host`` if it is an IP address or a DNS name (RFC 1123), else one line naming ``flag``."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(host) or host.replace(".", "").isdigit():
        raise FedMosaicError(f"{flag}: {host[:80]!r} is neither an IP address nor a host name (letters, digits, '-' "
                             "and '.'; an IPv6 address without brackets)")
    return host


def address(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_ports(port: int, link_port: int, node_port: int, nodes: int) -> None:
    """Every port 1-65535 and none used twice: the gateway's, the SuperLink's and the SuperNodes' (one each)."""
    last = node_port + nodes - 1
    for name, value in (("--port", port), ("--link-port", link_port), ("--node-port", node_port)):
        if not 1 <= value <= 65535:
            raise FedMosaicError(f"{name}: {value} is not a port (1-65535)")
    if last > 65535:
        raise FedMosaicError(f"--node-port: {nodes} SuperNodes from {node_port} need ports up to {last}, above 65535")
    nodes_range = range(node_port, last + 1)
    if port == link_port:
        raise FedMosaicError(f"--port and --link-port: both {port}; the gateway and the SuperLink need a port each")
    for name, value in (("--port", port), ("--link-port", link_port)):
        if value in nodes_range:
            raise FedMosaicError(f"{name}: {value} is among the SuperNodes' ports {node_port}-{last} (--node-port)")


def _retrying(command: str, k: int, tries: int = 24, wait_s: int = 5) -> str:
    """``command`` run again while it fails, ``tries`` times ``wait_s`` s apart (a bash snippet)."""
    return (f"for i in $(seq {tries}); do {command} && exit 0; echo 'fedmosaic: SuperNode {k} exited; trying "
            f"again in {wait_s} s' >&2; sleep {wait_s}; done; exit 1")


def check_model(cfg) -> None:
    """Build the run's server as the ServerApp will (data, partition, model, algorithm) — so a config a run would
    refuse is refused here, in one line, before anything is written."""
    import warnings

    from ..setup.world import build_federation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the run warns when it starts)
        build_federation(cfg, pool="none")


def public_key_pem(pub: Path) -> str:
    """The SubjectPublicKeyInfo PEM of an OpenSSH public key file: how the SuperLink lists a registered node's key."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_ssh_public_key(pub.read_bytes())
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def prepare(cfg, out: Path, *, host: str = "127.0.0.1", port: int = 9093, link_port: int = 9092,
            node_port: int = 9094, data_dir: str | None = None, hosts: list[str] | None = None,
            check: bool = True) -> str:
    """Write the deployment of ``cfg`` into the new directory ``out``; the commands (also in ``commands.sh``).
    Every argument is checked first: a bad one is one line and nothing is written. ``check``: also build the run's
    server once (its data, model and algorithm)."""
    import warnings

    import tomli_w

    from ..config import dump
    from ..engine import robust
    from ..protocol.algorithm import registered
    from ..runs.dirs import check_out

    algo = registered()[cfg.algorithm.name]
    check_deployable(cfg, algo)
    out = Path(out).absolute()
    if any(ord(c) < 32 or ord(c) == 127 for c in str(out)):  # commands.sh names it in comments and commands
        raise FedMosaicError(f"--out: {str(out)!r} holds a control character (a newline?); choose a plain name")
    check_out(out, resume=False, what="deployment directory")
    K = cfg.data.clients
    if K is None:
        raise FedMosaicError("data.clients: a deployment needs the number of clients (one SuperNode each)")
    if cfg.deploy.min_clients is not None and cfg.deploy.min_clients > K:
        raise FedMosaicError(f"deploy.min_clients: {cfg.deploy.min_clients} is more than the {K} clients (data.clients)")
    host = check_host(host)
    check_ports(port, link_port, node_port, K)
    if check:
        check_model(cfg)
    central_dp = cfg.privacy is not None and cfg.privacy.mode != "local"  # (DP-FedAvg clips every update itself)
    if robust.averaged(algo) and not central_dp and (cfg.aggregation is None or cfg.aggregation.rule == "mean"):
        warnings.warn("no aggregation.rule: a node's finite update moves the global model as far as it likes (a "
                      "x1000 model is averaged in); set one (norm_bound with a clip, median, trimmed_mean, krum) to "
                      "bound what one node can move", stacklevel=2)
    data_dir = data_dir if data_dir is not None else os.environ.get("FEDMOSAIC_DATA", "")
    app, pki, home = out / "app", out / "pki", out / "flwr"
    app_pkg = app / "fedmosaic_app"
    app_pkg.mkdir(parents=True)
    make_pki(pki, hosts or [host, *(["localhost"] if host == "127.0.0.1" else [])], K)
    home.mkdir()
    link = address("127.0.0.1", link_port)  # the SuperLink: the server's loopback only
    (home / "config.toml").write_text(tomli_w.dumps(
        {"superlink": {"default": LINK, LINK: {"address": link, "root-certificates": str(pki / "ca.crt")}}}))
    env = {**ENV, "FLWR_HOME": str(home), "OMP_NUM_THREADS": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}
    q = shlex.quote
    exports = " ".join(f"{k}={q(v)}" for k, v in env.items())
    run_dir = out / "run"
    resume = f"{exports} flwr run {q(str(app))} {LINK} --run-config 'resume=true'"
    (app / "pyproject.toml").write_text(tomli_w.dumps({
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": "fedmosaic-app", "version": "1.0.0",
                    "description": f"fedmosaic: {cfg.algorithm.name} on {cfg.data.dataset}",
                    "dependencies": ["fedmosaic"]},
        "tool": {"hatch": {"build": {"targets": {"wheel": {"packages": ["."]}}}},
                 "flwr": {"app": {"publisher": "fedmosaic",
                                  "components": {"serverapp": "fedmosaic_app.server_app:app",
                                                 "clientapp": "fedmosaic_app.client_app:app"},
                                  "config": {"run-dir": str(run_dir), "resume": False, "data-dir": data_dir,
                                             "resume-command": resume}}}}}))
    (app_pkg / "__init__.py").write_text("")
    (app_pkg / "server_app.py").write_text(SERVER)
    (app_pkg / "client_app.py").write_text(CLIENT)
    (app_pkg / "run.yaml").write_text(dump(cfg))
    (app_pkg / NODE_KEYS).write_text(json.dumps({str(k): public_key_pem(pki / f"node-{k}.pub") for k in range(K)},
                                                indent=1))
    public = address(host, port)

    def node_cmd(k: int) -> str:
        return (f"flower-supernode --superlink {q(public)} --root-certificates {q(str(pki / 'ca.crt'))} "
                f"--auth-supernode-private-key {q(str(pki / f'node-{k}'))} --port {node_port + k} "
                f"--node-config {q(node_config(k, out / 'nodes', data_dir))}")
    certs = (f"--ssl-ca-certfile {q(str(pki / 'ca.crt'))} --ssl-certfile {q(str(pki / 'server.pem'))} "
             f"--ssl-keyfile {q(str(pki / 'server.key'))}")
    lines = [
        "#!/usr/bin/env bash",
        f"# fedmosaic deployment of {cfg.name} ({cfg.algorithm.name}, {K} clients): run these in order, each",
        "# long-running one in its own terminal (or with & as here). Every command carries these settings: no",
        "# telemetry, no update check, the flwr CLI's home in this directory, one thread per process, a short task",
        "# poll. Under load, raise deploy.connect_timeout_s / deploy.round_timeout_s (README, Deploy with Flower).",
        "set -u",
        f"export {exports}",
        "# everything started here stops with this script (its process groups: the SuperExec children too)",
        "pids=()",
        "stop() { for p in \"${pids[@]}\"; do kill -TERM -- \"-$p\" 2>/dev/null; done; sleep 2;"
        " for p in \"${pids[@]}\"; do kill -KILL -- \"-$p\" 2>/dev/null; done; }",
        "trap stop EXIT",
        f"# 1. the SuperLink, on this machine's loopback only ({link}): TLS, only registered nodes, no installs at",
        "#    run time. Its Control API (register nodes, start, stop and list runs) is reachable from this machine alone.",
        "#    It keeps what it knows in memory: nothing a run needs (the run's state is in its run directory and on",
        "#    the nodes), so after any crash run steps 1-4 again as they are, then the resume command at the end.",
        f"setsid flower-superlink {certs} --enable-supernode-auth --disable-runtime-dependency-installation "
        f"--host 127.0.0.1 --port {link_port} & pids+=($!)",
        f"# 2. the fleet gateway on {public}, the one address nodes reach: TLS, the Fleet API's node calls alone",
        f"setsid fedmosaic gateway --listen {q(public)} --superlink {q(link)} --certfile {q(str(pki / 'server.pem'))} "
        f"--keyfile {q(str(pki / 'server.key'))} --ca {q(str(pki / 'ca.crt'))} "
        f"--max-body-mb {gateway_limit_mb(cfg.deploy.max_reply_mb)} --node-keys {q(str(app_pkg / NODE_KEYS))} "
        "& pids+=($!)",
        "# 3. register each node's public key, once the SuperLink answers",
        f"for i in $(seq 60); do flwr supernode list {LINK} >/dev/null 2>&1 && break; sleep 1; done",
        *[f"flwr supernode register {q(str(pki / f'node-{k}.pub'))} {LINK}" for k in range(K)],
        "# 4. one SuperNode per client, on its own machine (or its own --port here), with its private key; it",
        "#    reaches the gateway. 'Failed to activate SuperNode' means its key is not registered, or — a node",
        "#    restarted right after it crashed — that the SuperLink still lists it online (for up to ~60 s): each",
        "#    SuperNode here tries again every 5 s for 2 minutes",
        *[f"setsid bash -c {q(_retrying(node_cmd(k), k))} & pids+=($!)" for k in range(K)],
        f"# 5. the run: its results land in {run_dir} (fedmosaic report reads it)",
        f"flwr run {q(str(app))} {LINK} --stream",
        "# 6. flwr run exits 0 even when the run failed: its status says (finished:completed or finished:failed)",
        f"flwr ls {LINK} --format json",
        "# resume a stopped run (after restarting steps 1-4 as they are; README, Deploy with Flower):",
        f"# {resume}",
    ]
    text = "\n".join(lines) + "\n"
    (out / "commands.sh").write_text(text)
    return text
