"""``fedmosaic deploy``: the app, the PKI and the commands it writes, what it refuses, and (slow) that its
commands.sh brings up a TLS federation on localhost that finishes a run."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

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
    printed, err = capsys.readouterr()
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
    assert (out / "pki").stat().st_mode & 0o077 == 0  # and their folder (no one else lists or opens them)
    # the gateway refuses a node's body beyond a reply of deploy.max_reply_mb (512 MB) with its framing
    assert "--max-body-mb 648 " in printed
    # the commands: TLS, node authentication, no run-time installs, telemetry and update checks off
    for flag in ("--ssl-certfile", "--enable-supernode-auth", "--disable-runtime-dependency-installation",
                 "FLWR_TELEMETRY_ENABLED=0", "FLWR_DISABLE_UPDATE_CHECK=1", "flwr supernode register",
                 "partition-id=2", "flwr run", "resume=true"):
        assert flag in printed
    assert "--insecure" not in printed
    # FedAvg without a robust rule: a node's finite x1000 model would be averaged in - said in one line, on stderr
    assert err.count("\n") == 1 and "no aggregation.rule: a node's finite update moves the global model" in err, err
    # the control plane: the SuperLink and the operator's CLI on loopback, the nodes at the gateway
    home = (out / "flwr" / "config.toml").read_text()
    assert 'address = "127.0.0.1:9092"' in home and 'root-certificates = "' in home
    assert "--host 127.0.0.1 --port 9092" in printed and "fedmosaic gateway --listen 127.0.0.1:9093" in printed
    assert "--superlink 127.0.0.1:9093" in printed  # the SuperNodes reach the gateway
    assert f"--node-keys {out / 'app' / 'fedmosaic_app' / 'node_keys.json'} " in printed  # it checks their keys
    keys = json.loads((out / "app" / "fedmosaic_app" / "node_keys.json").read_text())
    assert sorted(keys) == ["0", "1", "2"] and all("BEGIN PUBLIC KEY" in v for v in keys.values())
    assert len(set(keys.values())) == 3


INJECTED = "127.0.0.1$(touch${IFS}pwned)"


@pytest.mark.parametrize("args, message", [
    (["--host", INJECTED], "--host: .* is neither an IP address nor a host name"),
    (["--host", "h\"\nx = 1"], "--host: .* is neither"),
    (["--host", "my host"], "--host: 'my host' is neither"),
    (["--host", ""], "--host: '' is neither"),
    (["--host", "[::1]"], "--host: .* is neither"),
    (["--host", "a" * 70 + ".org"], "--host: .* is neither"),
    (["--port", "70000"], "--port: 70000 is not a port"),
    (["--port", "0"], "--port: 0 is not a port"),
    (["--link-port", "-1"], "--link-port: -1 is not a port"),
    (["--node-port", "65534"], "--node-port: 3 SuperNodes from 65534 need ports up to 65536"),
    (["--port", "9092"], "--port and --link-port: both 9092"),
    (["--port", "9095"], "--port: 9095 is among the SuperNodes' ports 9094-9096"),
    (["--link-port", "9094"], "--link-port: 9094 is among the SuperNodes' ports"),
    (["--set", "deploy.min_clients=99"], "deploy.min_clients: 99 is more than the 3 clients"),
    (["--set", "model.name=resnet10", "--set", "model.options.width=-1"], "model"),
    (["--set", "algorithm.name=fedrecon", "--set", "data.tasks.n_tasks=5", "--set", "data.tasks.rounds_per_task=1",
      "--set", "train.rounds=5"], "fedrecon: encoder: first_task"),
])
def test_deploy_refuses_bad_arguments_in_one_line_and_writes_nothing(args, message, tmp_path, capsys):
    """Hostile or mistyped arguments: each one line before anything is written (no commands.sh to run an injected
    command, no TOML line to inject)."""
    assert main(["deploy", "deploy-quickstart", "--out", str(tmp_path / "dep"), *args]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "dep").exists() and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--superlink", "127.0.0.1:abc", "--superlink: '127.0.0.1:abc' is not HOST:PORT"),
    ("--superlink", "[::1", "--superlink: '.::1' is not HOST:PORT"),
    ("--superlink", "http://x:1", "--superlink: 'http://x' is neither an IP address nor a host name"),
    ("--superlink", "127.0.0.1:99999", "is not HOST:PORT"),
    ("--listen", "bad host:1", "--listen: 'bad host' is neither"),
])
def test_the_gateway_refuses_a_bad_address_in_one_line(flag, value, message, tmp_path, capsys):
    args = {"--listen": "127.0.0.1:1", "--superlink": "127.0.0.1:2", flag: value}
    assert main(["gateway", *[a for kv in args.items() for a in kv], "--certfile", "x", "--keyfile", "x",
                 "--ca", "x"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err


def test_the_gateway_refuses_a_node_keys_file_that_is_not_one_in_one_line(tmp_path, capsys):
    from fedmosaic.deploy.prepare import make_pki

    make_pki(tmp_path / "pki", ["127.0.0.1"], 1)
    (tmp_path / "keys.json").write_text('{"0": "not a key"}')
    p = {f: str(tmp_path / "pki" / n) for f, n in (("--certfile", "server.pem"), ("--keyfile", "server.key"),
                                                   ("--ca", "ca.crt"))}
    assert main(["gateway", "--listen", "127.0.0.1:1", "--superlink", "127.0.0.1:2", *[a for kv in p.items()
                 for a in kv], "--node-keys", str(tmp_path / "keys.json")]) == 2
    err = capsys.readouterr().err
    assert "--node-keys" in err and "not a JSON object of PEM public keys" in err and err.count("\n") == 1, err


def test_the_gateway_refuses_a_bad_certificate_key_ca_or_a_busy_address_in_one_line(tmp_path, capsys):
    """uvicorn's own failures were a log line and exit 1 (a port in use), or an SSL error naming no file."""
    import socket

    from fedmosaic.deploy.prepare import make_pki

    make_pki(tmp_path / "pki", ["127.0.0.1"], 1)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    pki = {f: str(tmp_path / "pki" / n) for f, n in (("--certfile", "server.pem"), ("--keyfile", "server.key"),
                                                     ("--ca", "ca.crt"))}
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        for over, needle in (({"--keyfile": str(tmp_path / "pki" / "ca.crt")}, "do not load as a PEM certificate"),
                             ({"--certfile": str(tmp_path / "junk.pem")}, "junk.pem and --keyfile"),
                             ({"--ca": str(tmp_path / "junk.pem")}, "--ca " + str(tmp_path / "junk.pem")),
                             ({}, f"cannot listen on 127.0.0.1:{port}: Address already in use")):
            given = {**pki, **over}
            assert main(["gateway", "--listen", f"127.0.0.1:{port}", "--superlink", "127.0.0.1:2",
                         *[a for kv in given.items() for a in kv]]) == 2
            err = capsys.readouterr().err
            assert err.startswith("fedmosaic: error: gateway: ") and needle in err and err.count("\n") == 1, err
    finally:
        busy.close()


@pytest.mark.parametrize("host, listen, node", [("::1", "'[::1]:9093'", "[::1]:9093"),
                                                ("node-7.example.org", "node-7.example.org:9093",
                                                 "node-7.example.org:9093")])
def test_deploy_writes_hosts_as_addresses_and_the_files_parse(host, listen, node, tmp_path):
    import shlex
    import tomllib

    out = tmp_path / "dep"
    assert main(["deploy", "deploy-quickstart", "--out", str(out), "--host", host]) == 0
    text = (out / "commands.sh").read_text()
    assert f"--listen {listen}" in text and f"flower-supernode --superlink {node}" in text.replace("'\"'\"'", "")
    for line in text.splitlines():  # every command splits into words as written (nothing unquoted)
        if line and not line.startswith("#"):
            shlex.split(line)
    tomllib.loads((out / "flwr" / "config.toml").read_text())
    pyproject = tomllib.loads((out / "app" / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"]["resume"] is False
    san = x509.load_pem_x509_certificate((out / "pki" / "server.pem").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    names = [str(v) for v in san.get_values_for_type(x509.IPAddress)] + san.get_values_for_type(x509.DNSName)
    assert host in names and "127.0.0.1" in names


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


def test_deploy_refuses_an_out_with_a_control_character(tmp_path, capsys):
    """commands.sh names the run directory in comment lines: a newline there would start a command."""
    out = tmp_path / "dep\ntouch pwned #"
    assert main(["deploy", "deploy-quickstart", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a control character" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_deploy_never_writes_into_an_existing_directory(tmp_path, capsys):
    (tmp_path / "dep").mkdir()
    (tmp_path / "dep" / "mine.txt").write_text("keep")
    assert main(["deploy", "deploy-quickstart", "--out", str(tmp_path / "dep")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "dep").iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("setting", ["aggregation={rule: norm_bound, clip: 1.0}", "privacy={noise: 1.0, clip: 1.0}"])
def test_deploy_with_a_robust_rule_or_central_dp_does_not_warn(setting, tmp_path, capsys):
    """DP-FedAvg clips every update itself (and refuses a rule beside it): no advice to set one."""
    assert main(["deploy", "deploy-quickstart", "--out", str(tmp_path / "dep"), "--set", "train.rounds=2",
                 "--set", setting]) == 0
    assert "aggregation.rule" not in capsys.readouterr().err


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
    # the script stopped what it started, each component in its own session (no orphan left to PID 1)
    import time

    def leftovers():
        mine = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if str(out).encode() in (proc / "cmdline").read_bytes():
                        mine.append(proc.name)
                except OSError:
                    pass
        return mine
    deadline = time.monotonic() + 30
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = leftovers()
    for pid in left:  # (the test stops them anyway, then fails)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    assert not left, f"left running: {left}"
