"""``fedmosaic deploy``: the app, the PKI and the commands it writes, what it refuses, and (slow) that its
commands.sh brings up a TLS federation on localhost that finishes a run."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("flwr")

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from fedmosaic.cli.main import main
from fedmosaic.config import load_config
from fedmosaic.presets import preset_path


def test_deploy_writes_the_app_the_pki_and_the_commands(tmp_path, capsys):
    out = tmp_path / "dep"
    assert main(["deploy", "deploy-quickstart", "--out", str(out), "--set", "train.rounds=2"]) == 0
    printed = capsys.readouterr().out
    assert printed == (out / "commands.sh").read_text()
    # the app: ServerApp and ClientApp of the resolved config, the run config keys a resume overrides
    assert load_config(out / "app" / "fedmosaic_app" / "run.yaml").train.rounds == 2
    pyproject = (out / "app" / "pyproject.toml").read_text()
    for key in ("run-dir", "resume = false", "data-dir", "resume-command", "fedmosaic_app.server_app:app",
                "fedmosaic_app.client_app:app"):
        assert key in pyproject
    # TLS: the server certificate is the CA's, for 127.0.0.1; private keys readable by their owner only
    ca = x509.load_pem_x509_certificate((out / "pki" / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((out / "pki" / "server.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    for k in range(3):  # node keys: P-384 in OpenSSH format, a matching pair
        key = load_ssh_private_key((out / "pki" / f"node-{k}").read_bytes(), None)
        pub = load_ssh_public_key((out / "pki" / f"node-{k}.pub").read_bytes())
        assert isinstance(key.curve, ec.SECP384R1) and key.public_key().public_numbers() == pub.public_numbers()
    for private in ("ca.key", "server.key", "node-0", "node-2"):
        assert (out / "pki" / private).stat().st_mode & 0o077 == 0
    # the commands: TLS, node authentication, no run-time installs, telemetry and update checks off
    for flag in ("--ssl-certfile", "--enable-supernode-auth", "--disable-runtime-dependency-installation",
                 "FLWR_TELEMETRY_ENABLED=0", "FLWR_DISABLE_UPDATE_CHECK=1", "flwr supernode register",
                 "partition-id=2", "flwr run", "resume=true"):
        assert flag in printed
    assert "--insecure" not in printed
    assert 'root-certificates = "' in (out / "flwr" / "config.toml").read_text()


@pytest.mark.parametrize("args, message", [
    (["quickstart"], "compare/seeds: a deployment runs one algorithm"),
    (["deploy-quickstart", "--set", "eval.local_models=true"], "eval.local_models"),
    (["deploy-quickstart", "--set", "algorithm.name=central"], "pooled data"),
])
def test_deploy_refuses_what_cannot_be_deployed_and_writes_nothing(args, message, tmp_path, capsys):
    assert main(["deploy", *args, "--out", str(tmp_path / "dep")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "dep").exists()


def test_deploy_never_writes_into_an_existing_directory(tmp_path, capsys):
    (tmp_path / "dep").mkdir()
    (tmp_path / "dep" / "mine.txt").write_text("keep")
    assert main(["deploy", "deploy-quickstart", "--out", str(tmp_path / "dep")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "dep").iterdir()] == ["mine.txt"]


def test_the_quickstart_preset_is_deployable():
    cfg = load_config(preset_path("deploy-quickstart"))
    assert cfg.compare is None and cfg.data.clients == 3 and cfg.train.clients_per_round == 3


@pytest.mark.slow
def test_commands_sh_runs_a_tls_federation_on_localhost_to_the_end(tmp_path):
    """The README's path: `fedmosaic deploy deploy-quickstart`, then `bash commands.sh` — a SuperLink with TLS and
    node authentication, three registered SuperNodes, `flwr run` — finishes the run; nothing is left running."""
    from harness import free_port

    out = tmp_path / "dep"
    port, node_port = free_port(), free_port()
    assert main(["deploy", "deploy-quickstart", "--out", str(out), "--set", "train.rounds=1", "--port", str(port),
                 "--node-port", str(node_port)]) == 0
    p = subprocess.Popen(["bash", str(out / "commands.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, cwd=tmp_path,
                         env={**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"})
    try:
        log, _ = p.communicate(timeout=400)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.decode(errors="replace")
    assert p.returncode == 0, text[-4000:]
    assert '"status": "finished:completed"' in text, text[-4000:]
    assert json.loads((out / "run" / "summary.json").read_text())["rounds"] == 1
