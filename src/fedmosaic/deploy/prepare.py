"""``fedmosaic deploy``: everything a Flower federation of one config needs, in one new directory.

- ``app/``: the Flower app (``pyproject.toml`` declaring the run config keys; ``fedmosaic_app/`` with the ServerApp,
  the ClientApp and the run's resolved config ``run.yaml``),
- ``pki/``: a certificate authority, the SuperLink's TLS certificate (for the addresses it is reached at) and key,
  and per client a SuperNode key pair (ECDSA P-384, OpenSSH format, as Flower's node authentication expects),
- ``flwr/config.toml``: the ``flwr`` CLI's connection to the SuperLink (``FLWR_HOME``),
- ``commands.sh``: the commands, in order — start the SuperLink (TLS, node authentication, no runtime installs),
  register each node's key, start each SuperNode with its partition, run, check the run's status.

Nothing that exists is overwritten: the directory must be new (or empty). Keys are written readable by their owner
only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
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
    """A CA, a server certificate for ``hosts`` (IP addresses or DNS names) and ``nodes`` SuperNode key pairs."""
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

    def private(path: Path, data: bytes) -> None:
        path.write_bytes(data)
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = build(_name("fedmosaic deployment CA"), _name("fedmosaic deployment CA"), ca_key.public_key(),
               basic=(x509.BasicConstraints(ca=True, path_length=0), True),
               usage=(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                                    encipher_only=False, decipher_only=False), True)).sign(ca_key, hashes.SHA256())
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = build(_name(hosts[0]), ca.subject, key.public_key(),
                 san=(x509.SubjectAlternativeName(names), False),
                 basic=(x509.BasicConstraints(ca=False, path_length=None), True),
                 eku=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)).sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True)
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    (out / "ca.crt").write_bytes(ca.public_bytes(pem))
    private(out / "ca.key", ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    (out / "server.pem").write_bytes(cert.public_bytes(pem))
    private(out / "server.key", key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    for k in range(nodes):
        node_key(out / f"node-{k}")


def node_key(path: Path) -> None:
    """A SuperNode key pair: ``path`` (private, OpenSSH) and ``path.pub`` (what the SuperLink registers)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    path.with_name(path.name + ".pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")


PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedmosaic-app"
version = "1.0.0"
description = "{description}"
dependencies = ["fedmosaic"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedmosaic"

[tool.flwr.app.components]
serverapp = "fedmosaic_app.server_app:app"
clientapp = "fedmosaic_app.client_app:app"

[tool.flwr.app.config]
run-dir = {run_dir}
resume = false
data-dir = {data_dir}
resume-command = {resume}
"""

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


def _toml(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def node_config(client: int, state_dir: str | Path, data_dir: str | None = None) -> str:
    """A SuperNode's ``--node-config``: the client it hosts, where it keeps its state, where its data are."""
    out = f"partition-id={client} state-dir={_toml(str(state_dir))}"
    return out + (f" data-dir={_toml(data_dir)}" if data_dir else "")


def prepare(cfg, out: Path, *, host: str = "127.0.0.1", port: int = 9093, node_port: int = 9094,
            data_dir: str | None = None, hosts: list[str] | None = None) -> str:
    """Write the deployment of ``cfg`` into the new directory ``out``; the commands (also in ``commands.sh``)."""
    from ..config import dump
    from ..engine.runner import check_out
    from ..protocol.algorithm import registered

    check_deployable(cfg, registered()[cfg.algorithm.name])
    out = Path(out).absolute()
    check_out(out, resume=False)
    K = cfg.data.clients
    if K is None:
        raise FedMosaicError("data.clients: a deployment needs the number of clients (one SuperNode each)")
    data_dir = data_dir if data_dir is not None else os.environ.get("FEDMOSAIC_DATA", "")
    app, pki, home = out / "app", out / "pki", out / "flwr"
    app_pkg = app / "fedmosaic_app"
    app_pkg.mkdir(parents=True)
    make_pki(pki, hosts or [host, *(["localhost"] if host == "127.0.0.1" else [])], K)
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{LINK}"\n\n[superlink.{LINK}]\naddress = "{host}:{port}"\n'
        f'root-certificates = {_toml(str(pki / "ca.crt"))}\n')
    env = " ".join(f"{k}={v}" for k, v in {**ENV, "FLWR_HOME": str(home)}.items())
    q = shlex.quote
    run_dir = out / "run"
    resume = f"{env} flwr run {q(str(app))} {LINK} --run-config 'resume=true'"
    (app / "pyproject.toml").write_text(PYPROJECT.format(
        description=f"fedmosaic: {cfg.algorithm.name} on {cfg.data.dataset}", run_dir=_toml(str(run_dir)),
        data_dir=_toml(data_dir), resume=_toml(resume)))
    (app_pkg / "__init__.py").write_text("")
    (app_pkg / "server_app.py").write_text(SERVER)
    (app_pkg / "client_app.py").write_text(CLIENT)
    (app_pkg / "run.yaml").write_text(dump(cfg))
    lines = [
        "#!/usr/bin/env bash",
        f"# fedmosaic deployment of {cfg.name} ({cfg.algorithm.name}, {K} clients): run these in order, each",
        "# long-running one in its own terminal (or with & as here). Every command carries FLWR_* settings: no",
        "# telemetry, no update check, the flwr CLI's home in this directory.",
        f"export {env}",
        "trap 'kill $(jobs -p) 2>/dev/null' EXIT  # the SuperLink and SuperNodes started here stop with this script",
        f"# 1. the SuperLink (TLS with {pki}/server.pem, only registered nodes, no installs at run time)",
        (f"flower-superlink --ssl-ca-certfile {q(str(pki / 'ca.crt'))} --ssl-certfile {q(str(pki / 'server.pem'))} "
         f"--ssl-keyfile {q(str(pki / 'server.key'))} --enable-supernode-auth "
         f"--disable-runtime-dependency-installation --host {host} --port {port} "
         f"--database {q(str(out / 'superlink.db'))} &"),
        "# 2. register each node's public key, once the SuperLink answers",
        f"for i in $(seq 60); do flwr supernode list {LINK} >/dev/null 2>&1 && break; sleep 1; done",
        *[f"flwr supernode register {q(str(pki / f'node-{k}.pub'))} {LINK}" for k in range(K)],
        "# 3. one SuperNode per client, on its own machine (or its own --port here), with its private key",
        *[f"flower-supernode --superlink {host}:{port} --root-certificates {q(str(pki / 'ca.crt'))} "
          f"--auth-supernode-private-key {q(str(pki / f'node-{k}'))} --port {node_port + k} "
          f"--node-config {q(node_config(k, out / 'nodes', data_dir))} &" for k in range(K)],
        "# 4. the run: its results land in " + str(run_dir) + " (fedmosaic report reads it)",
        f"flwr run {q(str(app))} {LINK} --stream",
        "# 5. flwr run exits 0 even when the run failed: its status says (finished:completed or finished:failed)",
        f"flwr ls {LINK} --format json",
        "# resume a stopped run:",
        f"# {resume}",
    ]
    text = "\n".join(lines) + "\n"
    (out / "commands.sh").write_text(text)
    return text
