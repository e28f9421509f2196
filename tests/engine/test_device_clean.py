"""Device-clean by construction: the client side of a round runs on a device that is not the CPU.

No GPU is needed: the engine runs on PyTorch's ``meta`` device, whose tensors have shapes but no data. Like a CUDA
tensor, a meta tensor refuses to meet a CPU tensor of one or more dimensions in an op (a zero-dimensional CPU scalar
is allowed, as on CUDA), and reading it on the host (``.item()``, ``bool()``, ``.cpu()``) fails — so a tensor an
algorithm or the engine makes on the CPU by mistake (a term at weight 0 returning a bare ``torch.zeros(())``, which
vmap turns into a CPU ``[n]`` loss that ``index_add_`` refuses on a GPU) fails here, and so does a host sync inside
local training. (torch's FakeTensorMode with a fake ``cuda`` device cannot stand in: on a CPU-only build,
``Tensor.to("cuda")`` and ``copy_`` initialise the CUDA device guard before dispatch and raise "PyTorch is not linked
with support for cuda devices".) The round's one host sync is the finite check after training, which is stubbed;
not run here: the server's aggregation and a task's end, which read on the host once per round or task (the
detectors, the labels whose exemplars a client keeps)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch
from deploy.cases import DIGITS3
from fedtest import CONTINUAL, HETERO, merged

from fedmosaic.config import validate
from fedmosaic.data.federated import build
from fedmosaic.engine import federation
from fedmosaic.engine.client.runtime import ClientRuntime
from fedmosaic.setup import world
from fedmosaic.setup.groups import data_spec
from fedmosaic.setup.world import build_federation

META = torch.device("meta")
PUBLIC = {"data": {"public": {"source": "noise", "size": 16}}}
CASES = {
    "fedavg": {}, "scaffold": {}, "ditto": {}, "ahf": HETERO, "protofcl": CONTINUAL,
    # every term at weight 0 (the CPU zero it returned broke index_add_ on a GPU: CFeD with lam 0)
    "cfed": merged(CONTINUAL, PUBLIC), "fedprox": {}, "fedntd": {}, "fedcurv": {}, "moon": {}, "fedlwf": CONTINUAL,
}
ZERO = {"cfed": {"lam": 0.0}, "fedprox": {"mu": 0.0}, "fedntd": {"beta": 0.0}, "fedcurv": {"lam": 0.0},
        "moon": {"mu": 0.0}, "fedlwf": {"lam": 0.0}}


@pytest.fixture
def on_meta(monkeypatch):
    monkeypatch.setattr(world, "resolve_device", lambda name: META)
    monkeypatch.setattr(world, "memory_bytes", lambda device: None)  # a meta tensor takes no memory
    monkeypatch.setattr(ClientRuntime, "_check_finite", lambda self, t, parts: None)  # the round's one host sync


@pytest.mark.parametrize("name", list(CASES))
def test_the_client_side_of_a_round_runs_on_a_device_that_is_not_the_cpu(on_meta, name):
    """The vectorized backend: what ``engine.backend: auto`` runs on a GPU."""
    raw = merged(merged(DIGITS3, CASES[name]), {"algorithm": {"name": name, **ZERO.get(name, {})},
                                                "engine": {"backend": "vectorized", "threads": 1}})
    cfg = validate(raw)
    fed = build_federation(cfg, build(data_spec(cfg)))
    srv, t = fed.srv, 0
    assignment = srv.assign(srv.cohort(t))
    # the protocol's client ids are read on the host (on a GPU: once per message, not in training)
    assignment["ids"] = torch.as_tensor(srv.cohort(t))
    if cfg.train.warmup_epochs:
        fed.pool.warm_up(srv.lr(t), {**srv.assign(fed.everyone), "ids": torch.as_tensor(fed.everyone)})
    shared = {}
    if fed.algo.exchanges:
        reply = fed.pool.public_logits(srv.broadcast(t, buffers=False), assignment, t)
        assert reply["logits"].device == META
        shared = srv.exchange(reply, t)
    parts = fed.pool.train(srv.header(t, srv.lr(t)), srv.broadcast(t, shared), assignment)
    for p in parts:
        for leaf in torch.utils._pytree.tree_leaves(p["upload"]):
            assert leaf.device == META, name


#: factory calls that must say where their tensor goes (a bare one makes a CPU tensor)
FACTORIES = {"zeros", "ones", "full", "empty", "tensor", "as_tensor", "arange", "eye", "rand", "randn", "randint"}


def test_no_algorithm_makes_a_tensor_without_saying_on_which_device():
    """Every ``torch.<factory>(...)`` in an algorithm names its device (``device=``, or ``ctx.zero()``, or a
    ``*_like``); host-side arithmetic on Python numbers says so with a ``# host`` comment on its line."""
    bare = []
    for path in sorted(Path(federation.__file__).parents[1].joinpath("algorithms").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                    and node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords) \
                    and "# host" not in lines[node.lineno - 1]:
                bare.append(f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bare, "\n".join(bare)


def test_the_precision_policy_sets_torch_for_a_cuda_run_and_leaves_a_cpu_run_alone(monkeypatch):
    from fedmosaic.setup.preflight import precision

    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,  # noqa: E731
                     torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                     torch.backends.cudnn.benchmark)
    before = flags()
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        precision(True, True, torch.device("cpu"))
        assert flags() == before
        precision(True, False, torch.device("cuda"))  # the defaults: exact, full float32
        assert flags() == (False, False, True, True, False) and torch.is_deterministic_algorithms_warn_only_enabled()
        assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        precision(False, True, torch.device("cuda:1"))  # fast: TF32, autotuned, nondeterministic kernels allowed
        assert flags() == (True, True, False, False, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.use_deterministic_algorithms(before[2], warn_only=False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[3:]


def test_fedmosaic_device_says_what_auto_means_and_a_wrong_one_is_one_line(monkeypatch):
    from fedmosaic.errors import ConfigError
    from fedmosaic.setup.preflight import resolve_device

    monkeypatch.setenv("FEDMOSAIC_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("FEDMOSAIC_DEVICE", "cuda:7")
    with pytest.raises(ConfigError, match=r"^\$FEDMOSAIC_DEVICE: 'cuda:7' is not available on this machine"):
        resolve_device("auto")
    assert resolve_device("cpu") == torch.device("cpu")  # a device the config names is the config's
    for wrong in ("gpu", "meta"):
        monkeypatch.setenv("FEDMOSAIC_DEVICE", wrong)
        with pytest.raises(ConfigError, match=rf"^\$FEDMOSAIC_DEVICE: '{wrong}' is not a device to train on"):
            resolve_device("auto")
    monkeypatch.delenv("FEDMOSAIC_DEVICE")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_a_compile_that_fails_here_falls_back_to_eager_with_one_warning(monkeypatch):
    """A GPU Triton cannot target, or a host without a compiler: training goes on eagerly, never exit 3."""
    import warnings

    from torch._dynamo.exc import BackendCompilerFailed

    from fedmosaic.engine.client import local

    def no_compiler(fn, dynamic=False):
        def call(*args):
            raise BackendCompilerFailed(fn, RuntimeError("no kernel image for sm_60"), None)
        return call

    cfg = validate(merged(DIGITS3, {"algorithm": {"name": "fedavg"},
                                    "engine": {"backend": "vectorized", "compile": True, "threads": 1}}))
    eager = validate(merged(DIGITS3, {"algorithm": {"name": "fedavg"},
                                      "engine": {"backend": "vectorized", "compile": False, "threads": 1}}))
    fd = build(data_spec(cfg))
    monkeypatch.setattr(local.torch, "compile", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fed = build_federation(cfg, fd)
        got = [fed.round(t)["train_loss"] for t in range(2)]
    said = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
    assert len(said) == 1 and "(RuntimeError: no kernel image for sm_60)" in said[0], said
    ref = build_federation(eager, fd)
    assert got == pytest.approx([ref.round(t)["train_loss"] for t in range(2)], rel=1e-6)


def test_a_gpu_run_is_sized_against_the_memory_still_free_once_its_data_is_there(monkeypatch):
    from fedmosaic.setup.preflight import memory_bytes

    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (asked.append(device), (3 << 30, 80 << 30))[1])
    assert memory_bytes(torch.device("cuda:1")) == 3 << 30 and asked == [torch.device("cuda:1")]


def test_the_activations_of_the_clients_trained_at_once_are_part_of_the_memory_check():
    """Measured on the meta device: linear in the batch, nothing for the parameters themselves; a chunk whose
    activations do not fit is refused before training, naming the knobs."""
    from fedmosaic.errors import ConfigError
    from fedmosaic.models import build_model
    from fedmosaic.setup.preflight import activation_bytes, check_training_memory

    mlp = build_model("mlp", (1, 8, 8), 10, hidden=32)
    one, two = activation_bytes(mlp, (1, 8, 8), 50), activation_bytes(mlp, (1, 8, 8), 100)
    assert 0 < one and two == pytest.approx(2 * one, rel=1e-3)  # (and a few scalars)
    # the input (50 x 64) and the hidden layer's output and activation (2 x 50 x 32) at least, in float32
    assert one >= 4 * 50 * (64 + 2 * 32)
    init = {k: v.detach() for k, v in mlp.named_parameters()}
    check_training_memory(mlp, init, 10, 4096, 8, 1 << 20, torch.device("cpu"), one)  # fits in 1 MiB
    with pytest.raises(ConfigError, match=r"activations per client and step; 10 client states, 128 clients trained "
                                          r"at once: engine.chunk_size"):
        check_training_memory(mlp, init, 10, 4096, 128, 1 << 20, torch.device("cpu"), one)


def test_measured_activations_are_kept_in_the_cache_and_a_damaged_entry_is_measured_again(tmp_path, monkeypatch):
    """A process that builds a run (each message of a deployed node is one) reads the measurement instead of
    importing torch's compiler stack for it; an entry is keyed by the batch and the model, and garbage in it is
    never believed."""
    import subprocess
    import sys

    from fedmosaic.models import build_model
    from fedmosaic.setup import preflight

    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path))
    monkeypatch.setattr(preflight, "_ACTIVATIONS", {})
    mlp = build_model("mlp", (1, 8, 8), 10, hidden=32)
    one = preflight.activation_bytes(mlp, (1, 8, 8), 50)
    (entry,) = (tmp_path / "activations").iterdir()
    assert json.loads(entry.read_text())["bytes"] == one
    assert preflight.activation_bytes(build_model("mlp", (1, 8, 8), 10, hidden=64), (1, 8, 8), 50) != one
    assert preflight.activation_bytes(mlp, (1, 8, 8), 51) != one
    assert len(list((tmp_path / "activations").iterdir())) == 3
    script = ("import sys, torch; from fedmosaic.setup.preflight import activation_bytes; "
              "from fedmosaic.models import build_model; "
              "print(activation_bytes(build_model('mlp', (1, 8, 8), 10, hidden=32), (1, 8, 8), 50), "
              "'torch._dynamo' in sys.modules)")
    env = {**os.environ, "FEDMOSAIC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(one), "False"], out.stderr
    for garbage in ("not json", json.dumps({"key": "another", "bytes": 1}), json.dumps({"bytes": -5})):
        entry.write_text(garbage)
        monkeypatch.setattr(preflight, "_ACTIVATIONS", {})
        assert preflight.activation_bytes(mlp, (1, 8, 8), 50) == one
    assert json.loads(entry.read_text())["bytes"] == one  # measured again and rewritten


def test_a_gpu_run_checks_the_host_memory_its_batch_plans_are_drawn_in(on_meta, monkeypatch):
    from fedmosaic.errors import ConfigError

    host = {"memory": None}
    monkeypatch.setattr(world, "memory_bytes", lambda device: host["memory"] if device.type == "cpu" else None)
    cfg = validate(merged(DIGITS3, {"algorithm": {"name": "fedavg"}, "engine": {"backend": "vectorized"}}))
    build_federation(cfg)  # the device (meta here, a GPU there) has room, and so has the host
    host["memory"] = 1 << 10
    with pytest.raises(ConfigError, match=r"the local batch plan .* more than the 0.0 MiB of memory on cpu"):
        build_federation(cfg)


def test_a_model_whose_activations_cannot_be_measured_without_data_still_runs(recwarn):
    from torch import nn

    from fedmosaic.setup.preflight import activation_bytes

    class ReadsItsData(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) * float(x.abs().max() > 0)  # a host read: no shapes-only forward can do it

    assert activation_bytes(ReadsItsData(), (4,), 8) == 0
    assert any("cannot be measured without data" in str(w.message) for w in recwarn)


def test_a_model_too_big_to_train_is_refused_without_being_built(tmp_path):
    """ResNet-34 at width 8 (1.36 billion parameters): measured on the meta device and refused in one line before
    the data are laid out or the model exists — in seconds, adding a few hundred MB (a read of the dataset) to a
    process that has imported torch and read CIFAR-100 once: not after minutes and 12 GB. (Alone on this VM the
    whole child peaks at ~0.45 GB; what else a test worker's environment makes it hold is not the check's.)"""
    import json
    import subprocess
    import sys

    from conftest import DATA_PATH, need_data

    need_data("cifar100")
    code = ("import json, resource, sys, time\nfrom fedmosaic.cli.main import main\n"
            "from fedmosaic.data.registry import load_dataset\n"
            "mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
            "ds = load_dataset('cifar100')\nbase = mb()\ndel ds\nt = time.time()\n"
            "rc = main(['run', '--out', sys.argv[1], '--no-progress', '--set', 'compare=null', '--set',"
            " 'algorithm.name=fedavg', '--set', 'data.dataset=cifar100', '--set', 'model.name=resnet34', '--set',"
            " 'model.options.width=8', '--set', 'engine.memory_mb=16000'])\n"
            "print(json.dumps({'rc': rc, 's': time.time() - t, 'base_mb': base, 'mb': mb()}))\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "FEDMOSAIC_DATA": DATA_PATH})
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rc"] == 2 and "training model 'resnet34' (1,361,087,076 parameters" in p.stderr, p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and not (tmp_path / "run").exists()
    assert out["mb"] - out["base_mb"] < 400, out  # (the model alone would be 5.4 GB, its training 45 GB)
    assert out["s"] < 30, out
