"""``engine.precision``: the forward passes under autocast, everything else float32. bf16 trains the CIFAR CNN, a
personalized and a continual algorithm to within a stated tolerance of float32 after the same rounds; fp16 is
refused in one line before anything is written; a resume in another precision needs --amend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_data
from fedtest import BLOBS6, CONTINUAL, merged, with_overrides

from fedmosaic.cli.main import main
from fedmosaic.config import validate
from fedmosaic.engine.federation import Federation
from fedmosaic.errors import ConfigError, FedMosaicError
from fedmosaic.protocol.tree import leaves
from fedmosaic.runs.runner import run
from fedmosaic.setup.world import build_federation


def trained(raw: dict, precision: str, rounds: int) -> tuple[Federation, list[float], dict]:
    fed = build_federation(with_overrides(merged(raw, {"engine": {"precision": precision}})))
    losses = [float(fed.round(t)["train_loss"]) for t in range(rounds)]
    return fed, losses, fed.evaluate(rounds - 1)


def test_the_forward_runs_in_bf16_and_the_objective_sees_float32():
    fed = build_federation(with_overrides(merged(BLOBS6, {"engine": {"precision": "bf16"}})))
    g = fed.groups[0]
    inside = []
    hook = next(m for m in g.module.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(
        lambda m, i, out: inside.append(out.dtype))
    try:
        z, logits = g.apply(g.init, torch.randn(3, *fed.split["train"].x.shape[1:], device=fed.device))
    finally:
        hook.remove()
    assert inside == [torch.bfloat16] * len(inside) and inside  # the layers computed in bfloat16
    assert z.dtype == logits.dtype == torch.float32  # what losses, softmaxes and distances are computed from
    assert all(t.dtype == torch.float32 for t in leaves(g.init))  # the parameters stay float32


@pytest.mark.parametrize("raw, rounds, key, tol", [
    # personalized: Ditto's personal models on the blob clients' test splits
    (merged(BLOBS6, {"algorithm": {"name": "ditto"}}), 6, ("personal", "acc"), 0.05),
    # continual: ProtoFCL's class-incremental accuracy after the last task (digits, 5 tasks)
    (merged(BLOBS6, {**CONTINUAL, "algorithm": {"name": "protofcl"}}), 5, ("continual", "seen_acc"),
     0.05),
    # a gradient probe (the Fisher at the received model), loss-scaled under fp16 too
    (merged(BLOBS6, {"algorithm": {"name": "fedcurv"}}), 6, ("global", "acc"), 0.05),
], ids=["ditto", "protofcl", "fedcurv"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lower_precision_trains_like_float32(raw, rounds, key, tol, precision, fp16_here):
    """The same rounds in both precisions: final accuracy within ``tol``, the round losses within 5%, and the
    numbers not identical (the lower precision really ran)."""
    _, la, ea = trained(raw, "fp32", rounds)
    _, lb, eb = trained(raw, precision, rounds)
    assert abs(ea[key[0]][key[1]] - eb[key[0]][key[1]]) <= tol, (ea[key[0]], eb[key[0]])
    np.testing.assert_allclose(lb, la, rtol=0.05)
    assert la != lb


@pytest.mark.slow
def test_bf16_trains_the_cifar_cnn_like_float32():
    """The FedAvg CNN (2.2 M parameters) on CIFAR-10, 100 IID clients, 5 per round, 8 rounds: the global test
    accuracy of bf16 within 2 points of float32 (measured here: see docs/benchmarks.md "Precision")."""
    need_data("cifar10")
    raw = {"seed": 0, "data": {"dataset": "cifar10", "clients": 100, "partition": {"scheme": "iid"}},
           "model": {"name": "fedavg_cnn"}, "algorithm": {"name": "fedavg"},
           "train": {"rounds": 8, "clients_per_round": 5, "local_epochs": 1, "batch_size": 50,
                     "optimizer": {"lr": 0.05}},
           "eval": {"global_test": True, "client_test": False}}
    _, la, ea = trained(raw, "fp32", 8)
    _, lb, eb = trained(raw, "bf16", 8)
    assert ea["global"]["acc"] > 0.2  # it learned
    assert abs(ea["global"]["acc"] - eb["global"]["acc"]) <= 0.02, (ea["global"]["acc"], eb["global"]["acc"])
    np.testing.assert_allclose(lb, la, rtol=0.05)


@pytest.mark.cpu  # (on a GPU machine too: the refusal is the CPU's)
def test_fp16_is_refused_off_cuda_in_one_line_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^engine\.precision: 'fp16' runs on CUDA GPUs only, not on 'cpu'") as e:
        build_federation(with_overrides(merged(BLOBS6, {"engine": {"precision": "fp16"}})))
    assert "\n" not in str(e.value)
    out = tmp_path / "run"
    assert main(["run", "--no-progress", "--out", str(out), "--set", "engine.precision=fp16"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedmosaic: ") and "engine.precision: 'fp16'" in err and "\n" not in err
    assert not out.exists()


@pytest.fixture
def fp16_here(monkeypatch):
    """fp16 let through on this CPU (torch autocasts to float16 on a CPU too, slowly): the engine's fp16 path —
    loss scale, overflow, recompute — runs here as it would on CUDA, where the preflight allows it."""
    import fedmosaic.setup.world as world

    allowed = world.check_precision
    monkeypatch.setattr(world, "check_precision", lambda p, dev: None if p == "fp16" else allowed(p, dev))


def one_step(fed: Federation, k: int = 0, **amp):
    """Client ``k`` of ``fed`` (FedAvg, plain SGD) trained one step on all its samples at once; the uploaded model."""
    from fedmosaic.protocol.program import Phase

    g, ids = fed.groups[0], np.array([k])
    out = g.trainer.train(fed.split["train"], ids, fed.algo.broadcast(fed.server, 0), g.store, g.buffers, lr=0.05,
                          seed=5, round_idx=0, own=fed.runtime.own(fed.assign(ids), ids),
                          program=[Phase(steps=1, batch=10_000)])
    assert out.steps.tolist() == [1]
    return {n: v[0] for n, v in out.uploads["model"].items()}


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_an_fp16_step_is_torch_gradscalers_step(fp16_here, backend):
    """Nothing overflows: the step is that of torch.amp.GradScaler (its default scale 2^16, unscaled gradients)
    on the same batch, with the forward pass under float16 autocast and the loss in float32."""
    from torch.func import functional_call

    fed = build_federation(with_overrides(merged(BLOBS6, {"engine": {"precision": "fp16", "backend": backend}})))
    got = one_step(fed)
    g, data = fed.groups[0], fed.split["train"]
    x, y = g.trainer.transform(data.x[data.ptr[0] : data.ptr[0] + data.sizes[0]]), data.y[data.ptr[0] : data.ptr[1]]
    start = {n: v.detach().clone().requires_grad_() for n, v in fed.server["model"].items()}
    scaler = torch.amp.GradScaler(x.device.type)
    with torch.autocast(x.device.type, dtype=torch.float16):
        _, logits = functional_call(g.module, start, (x,), {"with_features": True})
    loss = torch.nn.functional.cross_entropy(logits.float(), y)
    scaler.scale(loss).backward()
    opt = torch.optim.SGD(list(start.values()), lr=0.05)
    scaler.unscale_(opt)
    assert scaler.get_scale() == 2.0**16 and all(torch.isfinite(p.grad).all() for p in start.values())
    # vectorized: the batched float16 products round apart from the plain ones (float16's unit roundoff: 5e-4)
    tol = {"rtol": 1e-5, "atol": 1e-6} if backend == "sequential" else {"rtol": 1e-3, "atol": 1e-5}
    for n, p in start.items():
        torch.testing.assert_close(got[n], (p - 0.05 * p.grad).detach(), **tol)
    fp32 = build_federation(with_overrides(merged(BLOBS6, {"engine": {"backend": "sequential"}})))
    assert any(not torch.equal(got[n], v) for n, v in one_step(fp32).items())  # fp16 really ran


class BatchNormMLP(torch.nn.Module):
    """Linear, BatchNorm, ReLU, Linear: running statistics without convolutions (float16 convolutions crawl on a
    CPU)."""

    def __init__(self, shape, classes):
        super().__init__()
        d = int(np.prod(shape))
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(d, 8), torch.nn.BatchNorm1d(8),
                                        torch.nn.ReLU())
        self.classifier = torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.classifier(self.body(x))


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_an_overflowing_fp16_step_is_computed_again_at_half_the_scale_never_skipped(fp16_here, monkeypatch, backend):
    """Started at a scale of 2^40 every step overflows; each client's scale is halved and the step computed again
    until its gradients are finite: the same step (and, with BatchNorm, the running statistics moved once) as from
    the default scale, none skipped. With BatchNorm (sequential: buffers need the loop) and on the MLP (vectorized:
    one scale per client row)."""
    from fedmosaic.engine.client import objective
    from fedmosaic.models import MODELS, register_model

    if "bn_mlp_test" not in MODELS:
        register_model("bn_mlp_test", lambda shape, classes: BatchNormMLP(shape, classes), head="classifier")
    model = {"name": "bn_mlp_test" if backend == "sequential" else "mlp", "options": {}}
    raw = merged({**BLOBS6, "model": model}, {"engine": {"precision": "fp16", "backend": backend}})
    fed = build_federation(with_overrides(raw))
    checks = []
    finite = objective._finite
    monkeypatch.setattr(objective, "_finite", lambda *a: checks.append(1) or finite(*a))
    before = tmap_clone(fed.groups[0].buffers)
    want = one_step(fed, 2)
    first = len(checks)  # 1, or a few where the gradients overflow at 2^16 already (the BatchNorm MLP's: 5)
    stats = tmap_clone(fed.groups[0].buffers)
    fed.groups[0].buffers = tmap_clone(before)
    monkeypatch.setattr(objective, "SCALE_INIT", 2.0**40)
    got = one_step(fed, 2)
    assert len(checks) - first == first + 24  # overflowed, halved, computed again: 24 halvings more from 2^40
    for n, v in want.items():
        assert torch.isfinite(got[n]).all()
        assert torch.equal(got[n], v)  # the same final scale, reached from higher up
    for a, b in zip(leaves(fed.groups[0].buffers), leaves(stats), strict=True):
        assert torch.equal(a, b)  # the statistics moved by one forward pass, not by one per attempt
    assert backend == "vectorized" or any(not torch.equal(b, c) for b, c in zip(leaves(stats), leaves(before)))


def tmap_clone(tree):
    from fedmosaic.protocol.tree import tmap

    return tmap(torch.clone, tree)


def test_an_unknown_precision_is_a_config_error():
    with pytest.raises(ValueError, match="precision"):
        validate({"engine": {"precision": "fp8"}})


def test_a_resume_in_another_precision_needs_amend(tmp_path):
    raw = merged(BLOBS6, {"train": {"rounds": 2}, "checkpoint_every": 1})
    out = tmp_path / "run"
    run(with_overrides(merged(raw, {"train": {"rounds": 1}})), out, progress=False)
    bf16 = with_overrides(merged(raw, {"engine": {"precision": "bf16"}}))
    with pytest.raises(FedMosaicError, match=r"engine\.precision: 'fp32' -> 'bf16'.*--amend"):
        run(bf16, out, resume=True, progress=False)
    run(bf16, out, resume=True, amend=True, progress=False)  # from the next round on, recorded in meta.json
    assert (out / "meta.json").read_text().count("engine.precision") == 1


def test_bf16_is_refused_on_a_gpu_without_bfloat16_units(monkeypatch):
    """A Turing GPU (compute capability 7.5) emulates bfloat16: refused, naming the GPU; an Ampere one is not."""
    from fedmosaic.setup.preflight import check_precision

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ConfigError, match=r"^engine\.precision: 'bf16' needs a GPU with bfloat16 units .*Tesla T4"):
        check_precision("bf16", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    check_precision("bf16", torch.device("cuda"))
    check_precision("fp32", torch.device("cuda"))


@pytest.mark.parametrize("other", [{"pool": "wire"}, {"backend": "vectorized"}], ids=["wire-pool", "vectorized"])
def test_every_path_honours_bf16(other):
    """bf16 reaches the clients of a wire pool (each its own runtime, every message as bytes) with the numbers of
    the local pool, and the vectorized backend runs it like the sequential one (within bf16 rounding of the
    batched products: 1e-2)."""
    raw = merged(BLOBS6, {"algorithm": {"name": "ditto"}, "engine": {"precision": "bf16", "backend": "sequential"}})
    base = build_federation(with_overrides(raw))
    pool = other.pop("pool", None)
    alt = build_federation(with_overrides(merged(raw, {"engine": other})), **({"pool": pool} if pool else {}))
    for t in range(3):
        a, b = base.round(t), alt.round(t)
        tol = 0 if pool else 1e-2
        assert abs(float(a["train_loss"]) - float(b["train_loss"])) <= tol * abs(float(a["train_loss"]))
    fp32 = build_federation(with_overrides(merged(raw, {"engine": {"precision": "fp32"}})))
    for t in range(3):
        ref = fp32.round(t)
    assert float(ref["train_loss"]) not in (float(a["train_loss"]), float(b["train_loss"]))  # bf16 ran on both


@pytest.mark.parametrize("other", [{"pool": "wire"}, {"backend": "vectorized"},
                                   pytest.param({"backend": "vectorized", "compile": True, "fuse_steps": 3,
                                                 "threads": 1}, marks=pytest.mark.slow)],  # torch.compile
                         ids=["wire-pool", "vectorized", "compiled"])
def test_every_path_honours_fp16(fp16_here, other):
    """fp16's loss scale on every path: a wire pool's clients give the local pool's numbers exactly; the vectorized
    and compiled paths (compiled: steps never fused under fp16) train like the sequential one within float16
    rounding, and unlike float32."""
    raw = merged(BLOBS6, {"algorithm": {"name": "ditto"}, "engine": {"precision": "fp16", "backend": "sequential"}})
    base = build_federation(with_overrides(raw))
    pool = other.pop("pool", None)
    alt = build_federation(with_overrides(merged(raw, {"engine": other})), **({"pool": pool} if pool else {}))
    fp32 = build_federation(with_overrides(merged(raw, {"engine": {"precision": "fp32"}})))
    for t in range(3):
        a, b, ref = (float(f.round(t)["train_loss"]) for f in (base, alt, fp32))
        assert abs(a - b) <= (0 if pool else 1e-3) * abs(a)
    assert ref not in (a, b)  # fp16 ran on both
    assert "fused" not in alt.execution


def test_subnormals_are_left_alone_by_default():
    """``engine.denormals: keep`` leaves the process's floating-point mode as it was (IEEE gradual underflow here):
    1e-20 x 1e-20 is 1e-40, a subnormal, on every intra-op thread; nothing warns."""
    import warnings

    from fedmosaic.setup.preflight import _subnormal_products

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_federation(with_overrides(BLOBS6))
    assert float(_subnormal_products().min()) == pytest.approx(1e-40, rel=1e-3)


#: a fresh process: torch's intra-op pool started (``START=1``) or not before a run asks to flush subnormals
FLUSH_SCRIPT = """
import json, os, sys, warnings
import torch
sys.path.insert(0, sys.argv[1])
import conftest  # registers the blobs dataset
from fedtest import BLOBS6, merged, with_overrides
from fedmosaic.setup.preflight import _subnormal_products
from fedmosaic.setup.world import build_federation
torch.set_num_threads(2)
if not torch.set_flush_denormal(False):
    print(json.dumps("no flags")); sys.exit()
if os.environ["START"] == "1":
    torch.ones(1 << 20).mul_(2)  # starts the pool (each thread's flags as they are now: IEEE)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    build_federation(with_overrides(merged(BLOBS6, {"engine": {"denormals": "flush"}})))
torch.set_num_threads(2)  # (the run set its own: the pool's two threads again)
print(json.dumps({"said": [str(w.message) for w in said if "denormals" in str(w.message)],
                  "nonzero": int(_subnormal_products().ne(0).sum()), "main": float(torch.tensor([1e-20]) * 1e-20)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("started", [False, True])
def test_subnormals_are_flushed_on_request_by_every_thread_or_it_says_which_did_not(started):
    """``engine.denormals: flush`` in a fresh process: every intra-op thread computes subnormals as zero, silently.
    In a process whose thread pool ran before (its threads keep the flags they started with), the main thread
    flushes and the others do not: a warning says so (the numbers would depend on how work is split)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.run([sys.executable, "-c", FLUSH_SCRIPT, str(Path(__file__).resolve().parents[1])],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "START": str(int(started))})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if out == "no flags":
        pytest.skip("this CPU has no flush-to-zero flags")
    assert out["main"] == 0.0
    if started:
        assert out["nonzero"] > 0 and len(out["said"]) == 1 and "only some of torch's 2 threads" in out["said"][0]
    else:
        assert out["nonzero"] == 0 and out["said"] == [], out


def test_fp16_loss_scales_count_the_same_steps_whether_probes_are_looped_or_stacked(fp16_here):
    """A probe's stacked pass (vectorized) gives a client with fewer batches than the cohort's largest padding
    steps; the looped pass takes only its own. Under fp16 only a client's real steps count towards its scale's
    growth, so both backends leave each client the count of its own batches (FedCurv's Fisher probe over one
    pass of a ragged cohort)."""
    from fedmosaic.engine.client.objective import AMP
    from fedmosaic.protocol.program import Probe
    from fedmosaic.protocol.tree import tmap

    counts = []
    for backend in ("sequential", "vectorized"):
        fed = build_federation(with_overrides(merged(BLOBS6, {"algorithm": {"name": "fedcurv"},
                                                              "engine": {"precision": "fp16", "backend": backend}})))
        clients, sizes = np.arange(fed.num_clients), fed.split["train"].sizes
        n = len(clients)
        params = {"model": tmap(lambda t: t.expand(n, *t.shape).clone(), fed.server["model"])}
        own = {AMP: {"scale": torch.full((n,), 2.0**16), "good": torch.zeros(n, dtype=torch.int64)}}
        fed.groups[0].trainer.probe_at(fed.split["train"], clients, params, {}, fed.algo.broadcast(fed.server, 0), own,
                                       {}, [Probe("grad_sq", at="final")], seed=0, round_idx=0)
        counts.append(own[AMP]["good"].tolist())
    assert sizes.min() * 2 <= sizes.max(), "the cohort is not ragged: the test would prove nothing"
    batches = (-(-sizes // BLOBS6["train"]["batch_size"])).tolist()
    assert counts == [batches, batches], (counts, batches)
