"""Device-clean by construction: the client side of a round runs on a device that is not the CPU.

No GPU is needed: the engine runs on PyTorch's ``meta`` device, whose tensors have shapes but no data. Like a CUDA
tensor, a meta tensor refuses to meet a CPU tensor of one or more dimensions in an op (a zero-dimensional CPU scalar
is allowed, as on CUDA), and reading it on the host (``.item()``, ``bool()``, ``.cpu()``) fails — so a tensor an
algorithm or the engine makes on the CPU by mistake (a term at weight 0 returning a bare ``torch.zeros(())``, which
vmap turns into a CPU ``[n]`` loss that ``index_add_`` refuses on a GPU) fails here, and so does a host sync inside
local training. (torch's FakeTensorMode with a fake ``cuda`` device cannot stand in: on a CPU-only build,
``Tensor.to("cuda")`` and ``copy_`` initialise the CUDA device guard before dispatch and raise "PyTorch is not linked
with support for cuda devices".) The round's one host sync is the finite check after training, which is stubbed;
the server's aggregation reads its detector on the host and is not run here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from fedtest import CONTINUAL, HETERO, merged

from deploy.cases import DIGITS3
from fedmosaic.config import validate
from fedmosaic.data.federated import build
from fedmosaic.engine import federation
from fedmosaic.engine.build import data_spec
from fedmosaic.engine.client import ClientRuntime

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
    monkeypatch.setattr(federation, "resolve_device", lambda name: META)
    monkeypatch.setattr(federation, "memory_bytes", lambda device: None)  # a meta tensor takes no memory
    monkeypatch.setattr(ClientRuntime, "_check_finite", lambda self, t, parts: None)  # the round's one host sync


@pytest.mark.parametrize("name", list(CASES))
def test_the_client_side_of_a_round_runs_on_a_device_that_is_not_the_cpu(on_meta, name):
    """The vectorized backend: what ``engine.backend: auto`` runs on a GPU."""
    raw = merged(merged(DIGITS3, CASES[name]), {"algorithm": {"name": name, **ZERO.get(name, {})},
                                                "engine": {"backend": "vectorized", "threads": 1}})
    cfg = validate(raw)
    fed = federation.Federation(cfg, build(data_spec(cfg)))
    srv, t = fed.srv, 0
    assignment = srv.assign(srv.cohort(t))
    assignment["ids"] = torch.as_tensor(srv.cohort(t))  # the protocol's client ids, read on the host
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
