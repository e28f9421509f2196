"""The Python API (``fedmosaic.run``/``compare``/``Result``), datasets from numpy arrays, plain ``nn.Module`` models,
and plug-ins that let the command line see them — ending with the README's example, run as a user would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from fedtest import BLOBS6, train, with_overrides
from torch import nn

import fedmosaic
from fedmosaic import plugins
from fedmosaic.cli.main import main
from fedmosaic.data.federated import PartitionSpec, build
from fedmosaic.errors import ConfigError, FedMosaicError
from fedmosaic.models import Wrapped, build_model, head_keys, register_model
from fedmosaic.runs.records import read_metrics

REPO = Path(__file__).resolve().parents[1]

# ---- the README's example ("Python API"): the test below runs exactly this text ---------------------------------

MY_PLUGIN = '''\
# my_plugin.py: your data and your model, registered when the module is imported
import numpy as np
from torch import nn

import fedmosaic

rng = np.random.default_rng(0)
centers = rng.normal(0, 2, size=(4, 16))  # 4 classes, 16 features
y = rng.integers(0, 4, 1200)
x = (centers[y] + rng.normal(size=(1200, 16))).astype(np.float32)
fedmosaic.register_dataset("mydata", x[:1000], y[:1000], x[1000:], y[1000:], classes=["a", "b", "c", "d"])


class MyNet(nn.Module):  # a plain nn.Module: nothing in it is fedmosaic's
    def __init__(self, input_shape, num_classes, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[0], hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, num_classes)  # the head: its last nn.Linear with one output per class

    def forward(self, x):
        return self.fc(self.body(x))


fedmosaic.register_model("mynet", MyNet)
'''

SCRIPT = '''\
# compare.py
import fedmosaic
import my_plugin  # noqa: F401  (registers mydata and mynet)

config = {
    "name": "mine",
    "data": {"dataset": "mydata", "clients": 8, "partition": {"scheme": "dirichlet", "alpha": 0.5},
             "client_test": 0.2},
    "model": {"name": "mynet", "options": {"hidden": 32}},
    "train": {"rounds": 3, "clients_per_round": 4, "batch_size": 32, "optimizer": {"lr": 0.05}},
}
results = fedmosaic.compare(config, ["fedavg", "fedproto"], out="runs/mine")
for r in results:
    print(f"{r.name}: accuracy {r.accuracy:.3f} after {len(r.metrics)} rounds, in {r.dir}")
'''

COMMANDS = '''\
fedmosaic --plugin my_plugin report runs/mine
fedmosaic --plugin my_plugin run --resume runs/mine --amend --set train.rounds=5
'''

FEDMOSAIC = Path(sys.executable).with_name("fedmosaic")  # the installed command, as a user runs it


def shell(argv: list[str], cwd: Path, timeout: int = 300) -> tuple[int, str, str]:
    """Run ``argv`` in a child bounded in time (killed by its pid if it overruns), without plug-ins from the
    environment."""
    env = {k: v for k, v in os.environ.items() if k != plugins.ENV} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def cli(line: str, cwd: Path) -> tuple[int, str, str]:
    exe = [str(FEDMOSAIC)] if FEDMOSAIC.exists() else [sys.executable, "-m", "fedmosaic.cli.main"]
    return shell(exe + line.split()[1:], cwd)


@pytest.mark.slow
def test_the_readme_example_runs_and_the_cli_reports_and_resumes_it_with_the_plugin(tmp_path):
    (tmp_path / "my_plugin.py").write_text(MY_PLUGIN)
    (tmp_path / "compare.py").write_text(SCRIPT)
    rc, out, err = shell([sys.executable, "compare.py"], tmp_path)
    assert rc == 0, err[-2000:]
    assert re.search(r"^fedavg: accuracy [01]\.\d{3} after 3 rounds, in runs/mine/fedavg$", out, re.M), out
    assert re.search(r"^fedproto: accuracy [01]\.\d{3} after 3 rounds, in runs/mine/fedproto$", out, re.M), out
    run_dir = tmp_path / "runs" / "mine"
    for sub in ("fedavg", "fedproto"):
        assert json.loads((run_dir / sub / "meta.json").read_text())["plugins"] == ["my_plugin"]

    # without the plug-in: one line naming the dataset and the option to pass
    for line in ("fedmosaic report runs/mine", "fedmosaic run --resume runs/mine"):
        rc, out, err = cli(line, tmp_path)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert "unknown dataset 'mydata'" in err and "pass --plugin my_plugin" in err, err

    report, resume = COMMANDS.splitlines()
    rc, out, err = cli(report, tmp_path)
    assert rc == 0, err[-2000:]
    assert re.search(r"^fedavg +3 ", out, re.M) and re.search(r"^fedproto +3 ", out, re.M), out
    rc, out, err = cli(resume, tmp_path)
    assert rc == 0, err[-2000:]
    for sub in ("fedavg", "fedproto"):  # the plug-in's model trained the two rounds added
        assert [r["round"] for r in read_metrics(run_dir / sub)] == [0, 1, 2, 3, 4]


def test_the_readme_shows_the_tested_example():
    readme = (REPO / "README.md").read_text()
    section = re.search(r"^## Python API$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section, "README.md has no '## Python API' section"
    blocks = re.findall(r"```(\w*)\n(.*?)```", section.group(1), re.S)
    assert [b for lang, b in blocks if lang == "python"] == [MY_PLUGIN, SCRIPT]
    assert COMMANDS in [b for lang, b in blocks if lang in ("sh", "bash", "console")]


# ---- run / compare / Result ------------------------------------------------------------------------------------

SMALL = {**BLOBS6, "name": "small", "train": {**BLOBS6["train"], "rounds": 2}}


def test_run_and_compare_take_a_dict_a_yaml_file_or_a_runconfig_and_return_results(tmp_path, monkeypatch):
    yml = tmp_path / "small.yaml"
    yml.write_text(yaml.safe_dump(SMALL))
    one = fedmosaic.run(SMALL, tmp_path / "dict", progress=False)
    assert one.name == "small" and one.dir == tmp_path / "dict" and one.config.train.rounds == 2
    assert [r["round"] for r in one.metrics] == [0, 1] and one.summary["rounds"] == 2
    assert one.accuracy == one.summary["global_acc_final"] == one.metrics[-1]["global"]["acc"]
    for config, out in ((str(yml), "str"), (yml, "path"), (with_overrides(dict(SMALL)), "runconfig")):
        again = fedmosaic.run(config, str(tmp_path / out), progress=False)
        assert again.metrics[-1]["global"] == one.metrics[-1]["global"]  # the same run, whatever form the config took
    both = fedmosaic.compare(SMALL, ["fedavg", {"name": "fedprox", "mu": 0.1}], tmp_path / "cmp", progress=False)
    assert [r.name for r in both] == ["fedavg", "fedprox(mu=0.1)"]
    assert [r.dir for r in both] == [tmp_path / "cmp" / "fedavg", tmp_path / "cmp" / "fedprox_mu=0.1"]
    assert both[0].metrics[-1]["global"] == one.metrics[-1]["global"]
    assert fedmosaic.api.Result.load(both[1].dir).summary == both[1].summary
    monkeypatch.chdir(tmp_path)  # no out: a new directory under ./runs, as the CLI
    made = fedmosaic.run(SMALL, progress=False)
    assert made.dir.parent == Path("runs") and made.dir.name.startswith("small-")


def test_run_refuses_a_comparison_and_resume_continues_one(tmp_path):
    with pytest.raises(ConfigError, match="use fedmosaic.compare"):
        fedmosaic.run({**SMALL, "compare": [{"name": "fedavg"}, {"name": "local"}]}, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
    out = tmp_path / "cmp"
    fedmosaic.compare(SMALL, ["fedavg", "local"], out, progress=False)
    more = with_overrides(yaml.safe_load((out / "comparison.yaml").read_text()), train__rounds=3)
    with pytest.raises(FedMosaicError, match="--amend"):  # the same rule as the CLI: a changed config needs amend
        fedmosaic.compare(more, out=out, resume=True, progress=False)
    done = fedmosaic.compare(more, out=out, resume=True, amend=True, progress=False)
    assert [[r["round"] for r in res.metrics] for res in done] == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(FedMosaicError, match=r"holds a comparison: load one of its directories \(fedavg, local\)"):
        fedmosaic.api.Result.load(out)


# ---- datasets from numpy arrays --------------------------------------------------------------------------------

def gaussian(n, d=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    return (rng.normal(size=(classes, d))[y] * 3 + rng.normal(size=(n, d))), y


def test_a_registered_array_dataset_partitions_and_trains_like_a_builtin(tmp_path):
    x, y = gaussian(400)
    x_user = x.copy()
    spec = fedmosaic.register_dataset("api_gauss", x_user, y, x[:50], y[:50], classes=["a", "b", "c"])
    ds = spec.layouts[0].read(Path("."))
    assert ds.x_train.dtype == np.float32 and ds.input_shape == (5,) and ds.classes == ["a", "b", "c"]
    for scheme in ({"scheme": "dirichlet", "alpha": 0.3}, {"scheme": "iid"}, {"scheme": "label_k", "k": 2}):
        fd = build(PartitionSpec("api_gauss", 6, scheme, client_test=0.2), cache=False)
        assert fd.num_clients == 6 and fd.sizes().sum() + fd.sizes("test").sum() == 400
    before = build(PartitionSpec("api_gauss", 6, {"scheme": "iid"}), cache=False).hash
    x_user[:] = 0  # the user's array changing afterwards changes nothing registered
    assert build(PartitionSpec("api_gauss", 6, {"scheme": "iid"}), cache=False).hash == before
    cfg = {**SMALL, "data": {"dataset": "API_Gauss", "clients": 6, "partition": {"scheme": "iid"}}}
    r = fedmosaic.run(cfg, tmp_path / "run", progress=False)
    assert r.accuracy > 0.5  # three well separated Gaussians: learnt, so the data went through as given
    # uint8 images are pixel values; flat rows take their shape from input_shape
    img = fedmosaic.register_dataset("api_img", np.full((20, 16), 255, np.uint8), np.arange(20) % 2,
                                     input_shape=(1, 4, 4)).layouts[0].read(Path("."))
    assert img.x_train.dtype == np.uint8 and img.input_shape == (1, 4, 4) and img.y_test is None


@pytest.mark.parametrize("args, message", [
    (dict(y_train=np.arange(400) % 3 * 1.0), "y_train must hold integer labels 0..C-1 (got dtype float64)"),
    (dict(classes=2), "y_train holds labels 0..2, outside 0..1 (2 classes)"),
    (dict(x_train=np.zeros(400)), "x_train must hold one row per sample"),
    (dict(x_train=np.full((400, 5), np.nan)), "x_train holds NaN or infinite values"),
    (dict(x_train=np.array([["a"] * 5] * 400)), "x_train must hold real numbers"),
    (dict(x_test=np.zeros((5, 5))), "give both x_test and y_test, or neither"),
    (dict(x_test=np.zeros((5, 4)), y_test=np.zeros(5, int)), "x_test rows are float32 (4,), x_train rows float32 (5,)"),
    (dict(y_train=np.zeros(400, int)), "needs at least 2 classes"),
    (dict(input_shape=(2, 2)), "cannot be read as rows of input_shape (2, 2)"),
    (dict(y_train=np.arange(400) % 3 + 20230101), "its labels span 20,230,104 classes, 20,230,101 of them without"),
    (dict(y_train=np.arange(400) % 3 + 10**12), "its labels span 1,000,000,000,003 classes"),  # refused before made
])
def test_a_dataset_that_cannot_work_is_refused_in_one_line(args, message):
    x, y = gaussian(400)
    with pytest.raises(ConfigError) as e:
        fedmosaic.register_dataset("api_bad", **{"x_train": x, "y_train": y, **args})
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("register_dataset(")


@pytest.mark.parametrize("returned, message", [
    (lambda mean: {"model": {k: t.double() for k, t in mean.items()}}, "float64 where the state had"),
    (lambda mean: mean, "where the state had model/"),  # the {"model": ...} forgotten
])
def test_an_aggregate_that_changes_the_states_layout_is_one_line(returned, message, blob_data):
    from fedtest import blobs6_partition

    from fedmosaic.protocol.tree import weighted_mean

    name = f"api_agg_{len(message)}"

    def aggregate(self, server, uploads, weights, round_idx, signals):
        return returned(weighted_mean(uploads["model"], weights))

    fedmosaic.register_algorithm(type("Agg", (fedmosaic.Algorithm,), {"name": name, "aggregate": aggregate,
                                                                       "__module__": __name__}))
    with pytest.raises(ConfigError, match=f"algorithm '{name}': aggregate returned a server state of another "
                                          f"layout .*{message}"):
        train(with_overrides(dict(BLOBS6), algorithm={"name": name}), blobs6_partition(blob_data))


def test_an_algorithms_config_must_be_strict_and_a_required_field_is_listed_as_such():
    import pydantic

    from fedmosaic.reports.catalog import field_lines

    class Loose(pydantic.BaseModel):  # would accept algorithm.muu=5 silently
        mu: float = 0.1

    with pytest.raises(ConfigError, match=r"register_algorithm\('api_loose'\): its Config must subclass "
                                          r"fedmosaic.AlgoConfig"):
        fedmosaic.register_algorithm(type("L", (fedmosaic.Algorithm,), {"name": "api_loose", "Config": Loose}))

    class Needs(fedmosaic.AlgoConfig):
        lam: float = pydantic.Field(gt=0)

    assert field_lines(Needs)[0].startswith("lam: float (required)  (> 0)")


def test_class_names_from_numpy_and_labels_that_skip_classes_are_said():
    names = np.array(["dog", "cat", "cow"])[np.arange(400) % 3]
    classes, y = np.unique(names, return_inverse=True)  # what the label error suggests: accepted as given
    x, _ = gaussian(400)
    ds = fedmosaic.register_dataset("api_animals", x, y, classes=classes).layouts[0].read(Path("."))
    assert ds.classes == ["cat", "cow", "dog"]
    assert fedmosaic.register_dataset("api_animals", x, y, classes=np.int64(3))  # a numpy count too
    with pytest.warns(UserWarning, match=r"1 of its 4 classes has no training sample \(e.g. 0\)"):
        fedmosaic.register_dataset("api_from_one", x, y + 1)  # labels 1..3: class 0 never occurs
    with pytest.warns(UserWarning, match=r"x_train of shape \(400, 8, 8, 3\) looks channels-last"):
        fedmosaic.register_dataset("api_nhwc", np.zeros((400, 8, 8, 3), np.uint8), y)


def test_names_are_owned_by_the_module_that_registered_them():
    x, y = gaussian(50)
    with pytest.raises(ConfigError, match="a built-in dataset has that name"):
        fedmosaic.register_dataset("digits", x, y)
    fedmosaic.register_dataset("api_owned", x, y)
    fedmosaic.register_dataset("api_owned", x, y)  # again from here (a notebook cell run twice): replaced
    other = {"__name__": "someone_else", "fedmosaic": fedmosaic, "x": x, "y": y}
    with pytest.raises(ConfigError, match="already registered by test_api"):
        exec("fedmosaic.register_dataset('api_owned', x, y)", other)
    with pytest.raises(ConfigError, match="a built-in model has that name"):
        register_model("mlp", PlainMLP)
    # algorithms alike, whether or not the built-ins were imported yet (a plug-in could take one's name first)
    code = ("@fedmosaic.register_algorithm\nclass Mine(fedmosaic.Algorithm):\n    name = {!r}\n"
            "    personalized = False\n")
    with pytest.raises(ConfigError, match=r"register_algorithm\('fedavg'\): a built-in algorithm has that name"):
        exec(code.format("fedavg"), {"__name__": "api_mine", "fedmosaic": fedmosaic})
    for _ in range(2):  # the same module again: replaced
        exec(code.format("api_mine"), {"__name__": "api_mine", "fedmosaic": fedmosaic})
    with pytest.raises(ConfigError, match="already registered by api_mine"):
        exec(code.format("api_mine"), other)
    assert fedmosaic.protocol.algorithm.registered()["fedavg"].__module__ == "fedmosaic.algorithms.fedavg"


# ---- plain nn.Module models ------------------------------------------------------------------------------------

class PlainMLP(nn.Module):
    def __init__(self, input_shape, num_classes, hidden=8):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


def wrapped_mlp(input_shape, num_classes, hidden=8):  # the same network written for fedmosaic
    body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), hidden), nn.ReLU())
    return Wrapped(body, nn.Linear(hidden, num_classes))


def ensure(name, factory, **kw):
    from fedmosaic.models import MODELS

    if name not in MODELS:
        register_model(name, factory, **kw)


@pytest.mark.slow
def test_a_plain_module_splits_at_its_last_linear_and_trains_exactly_as_the_wrapped_one(blob_data):
    ensure("api_plain", PlainMLP)
    ensure("api_wrapped", wrapped_mlp)
    m = build_model("api_plain", (1, 6, 6), 5)
    assert type(m).__name__ == "PlainMLP" and m.feature_dim == 8
    assert head_keys(m) == ("net.fc.weight", "net.fc.bias")
    x = torch.randn(3, 1, 6, 6)
    z, logits = m(x, with_features=True)
    torch.testing.assert_close(z, m.net.body(x))
    torch.testing.assert_close(logits, m.net(x))
    from fedtest import blobs6_partition

    fd = blobs6_partition(blob_data)
    for algo in ({"name": "fedpac", "lam": 1.0}, {"name": "fedproto", "lam": 1.0}, {"name": "moon"}):
        feds = [train(with_overrides(dict(BLOBS6), model={"name": n, "options": {}}, algorithm=algo), fd)
                for n in ("api_plain", "api_wrapped")]
        assert feds[0].evaluate() == feds[1].evaluate(), algo  # the split is the one written by hand


class LogSoftmax(PlainMLP):
    def forward(self, x):
        return torch.log_softmax(self.fc(self.body(x)), -1)


class HeadFirst(nn.Module):  # the last nn.Linear registered is not the classifier, but `head=` says which is
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.out = nn.Linear(16, num_classes)
        self.proj = nn.Linear(int(np.prod(input_shape)), 16)
        self.aux = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x.flatten(1))))


class Tokens(nn.Module):  # its classifier runs on every row of the image, then the rows are averaged
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(input_shape[-1], num_classes)

    def forward(self, x):
        return self.fc(x[:, 0]).mean(1)


class NoHead(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 7))

    def forward(self, x):
        return self.net(x)[:, :5]


@pytest.mark.parametrize("name, cls, head, message", [
    ("api_logsoftmax", LogSoftmax, None, ("its output is not the output of 'fc', taken as its classifier head; give "
                                          "register_model('api_logsoftmax', ..., head='<the sub-module that outputs "
                                          "its 5 logits>')")),
    ("api_headfirst", HeadFirst, None, "'aux', taken as its classifier head, ran 0 times in one forward pass"),
    ("api_proj", HeadFirst, "proj", "its output is not the output of 'proj', taken as its classifier head"),
    ("api_tokens", Tokens, None, ("'fc', taken as its classifier head, receives inputs of shape (6, 6), not one "
                                  "flat feature vector per sample")),
    ("api_nohead", NoHead, None, "it has no nn.Linear with 5 outputs (one per class) to take as its classifier head"),
    ("api_badhead", HeadFirst, "nope", "head='nope' is not a sub-module of HeadFirst (it has: out, proj, aux)"),
])
def test_a_plain_module_whose_head_cannot_be_found_says_what_to_add(name, cls, head, message):
    ensure(name, cls, head=head)
    with pytest.raises(ConfigError) as e:
        build_model(name, (1, 6, 6), 5)
    assert message in str(e.value) and str(e.value).startswith(f"model {name!r}") and "\n" not in str(e.value)


def test_head_names_the_classifier_and_a_factory_must_take_shape_and_classes():
    ensure("api_headfirst_named", HeadFirst, head="out")
    m = build_model("api_headfirst_named", (1, 6, 6), 5)
    assert m.feature_dim == 16 and head_keys(m) == ("net.out.weight", "net.out.bias")

    class NoArgs(nn.Module):
        def __init__(self):
            super().__init__()

    with pytest.raises(ConfigError, match=r"calls NoArgs\(input_shape, num_classes, \*\*options\), which it does not "
                                          r"accept; register a factory such as `lambda input_shape, num_classes"):
        register_model("api_noargs", NoArgs)
    with pytest.raises(ConfigError, match=r"the name comes first: register_model\('mynet', MyNet\)"):
        register_model(PlainMLP)  # the name forgotten (or a bare @register_model)
    with pytest.raises(ConfigError, match="must be letters, digits"):
        register_model("has space", PlainMLP)

    class Needs(PlainMLP):  # an option without a default: the config must give it
        def __init__(self, input_shape, num_classes, width):
            super().__init__(input_shape, num_classes, hidden=width)

    ensure("api_needs", Needs)
    assert build_model("api_needs", (1, 6, 6), 5, width=3).feature_dim == 3
    with pytest.raises(ConfigError, match="missing 1 required positional argument: 'width'"):
        build_model("api_needs", (1, 6, 6), 5)


class Frozen(PlainMLP):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.body[1].requires_grad_(False)


class Double(PlainMLP):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.double()


class Pair(PlainMLP):
    def forward(self, x):
        z = self.body(x)
        return self.fc(z), z


@pytest.mark.parametrize("name, cls, message", [
    ("api_frozen", Frozen, "parameter 'body.1.weight' is frozen (requires_grad=False): fedmosaic trains every "
                           "parameter; keep a fixed tensor as a buffer"),
    ("api_double", Double, "parameter 'body.1.weight' is torch.float64: fedmosaic trains float32 parameters"),
    ("api_pair", Pair, "its forward returns a tuple, not one tensor of logits per sample"),
])
def test_a_model_the_engine_cannot_train_as_written_is_refused_in_one_line(name, cls, message):
    ensure(name, cls)
    with pytest.raises(ConfigError) as e:
        build_model(name, (1, 6, 6), 5)
    assert message in str(e.value) and "\n" not in str(e.value)


class Dropped(PlainMLP):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes, hidden=16)
        self.body.append(nn.Dropout(0.5))


class FunctionalDropout(PlainMLP):
    def forward(self, x):
        return self.fc(torch.nn.functional.dropout(self.body(x), 0.5, self.training))


def test_a_model_with_dropout_trains_the_same_on_every_run_pool_and_resume(blob_data, tmp_path):
    """Its masks are drawn per client and step from the run's seed (the loop: vmap cannot draw them per client),
    so two runs, the wire pool and a resume give the same numbers."""
    from fedtest import blobs6_partition

    from fedmosaic.runs.runner import run

    ensure("api_dropped", Dropped)
    fd = blobs6_partition(blob_data)
    cfg = with_overrides(dict(BLOBS6), model={"name": "api_dropped", "options": {}},
                         engine={"backend": "vectorized"})
    feds = [train(cfg, fd), train(cfg, fd), train(with_overrides(cfg.model_dump(), engine={"pool": "wire"}), fd)]
    assert feds[0].groups[0].execution.backend == "sequential"  # (asked for vmap: the loop, said so)
    assert feds[0].evaluate() == feds[1].evaluate() == feds[2].evaluate()
    # whatever the process's generator holds; a probe's pass (FedCurv's Fisher) and the public stream's logits
    # (FedMD) too, and a functional dropout on the sequential path
    ensure("api_fdrop", FunctionalDropout)
    for over in ({"algorithm": {"name": "fedcurv", "lam": 0.1}},
                 {"algorithm": {"name": "fedmd"}, "data": {**BLOBS6["data"], "public": {"source": "noise", "size": 16}}},
                 {"model": {"name": "api_fdrop", "options": {}}, "engine": {"backend": "sequential"}}):
        c = with_overrides(cfg.model_dump(), **over)
        results = []
        for noise in (1, 2):
            torch.manual_seed(noise)
            results.append(train(c, fd).evaluate())
        assert results[0] == results[1], over
    raw = {**cfg.model_dump(), "train": {**cfg.train.model_dump(), "rounds": 3}, "checkpoint_every": 1}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(fedmosaic.config.validate(raw), whole, progress=False)
    run(fedmosaic.config.validate(raw), cut, progress=False, stop_after=2)
    assert main(["run", "--resume", str(cut), "--no-progress"]) == 0
    losses = [[json.loads(line)["train_loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (whole, cut)]
    assert losses[0] == losses[1]


def test_random_ops_vmap_cannot_draw_are_one_line_naming_the_sequential_backend(tmp_path, capsys):
    ensure("api_fdrop", FunctionalDropout)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BLOBS6, "model": {"name": "api_fdrop"}, "engine": {"backend": "vectorized"},
                                   "train": {**BLOBS6["train"], "rounds": 1}}))
    assert main(["run", str(cfg), "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "draws random numbers in its forward pass (dropout?)" in err and "engine.backend: sequential" in err


# ---- plug-ins --------------------------------------------------------------------------------------------------

def plugin_module(folder: Path, module: str, dataset: str) -> None:
    (folder / f"{module}.py").write_text(
        "import numpy as np\nimport fedmosaic\n"
        f"fedmosaic.register_dataset({dataset!r}, np.eye(4, dtype=np.float32).repeat(5, 0), np.arange(20) % 2)\n")


def test_plugins_come_from_the_option_the_environment_and_entry_points(tmp_path, monkeypatch, capsys):
    from fedmosaic.data.registry import REGISTRY

    monkeypatch.syspath_prepend(str(tmp_path))
    plugin_module(tmp_path, "api_plug_opt", "api_from_option")
    plugin_module(tmp_path, "api_plug_env", "api_from_env")
    plugin_module(tmp_path, "api_plug_ep", "api_from_entry_point")
    dist = tmp_path / "api_plug_ep-1.0.dist-info"  # an installed package declaring the entry point
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: api-plug-ep\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fedmosaic.plugins]\nmine = api_plug_ep\n")
    monkeypatch.setenv(plugins.ENV, "api_plug_env")
    assert main(["--plugin", "api_plug_opt", "list", "datasets"]) == 0
    listed = capsys.readouterr().out
    for name in ("api_from_option", "api_from_env", "api_from_entry_point"):
        assert name in REGISTRY and name in listed
    assert plugins.used_by(with_overrides({"data": {"dataset": "api_from_env"}})) == ["api_plug_env"]


def test_a_broken_installed_plugin_is_a_warning_and_named_where_its_names_are_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "BROKEN", {})
    (tmp_path / "api_plug_bad.py").write_text("import fedmosaic\n1 / 0\n")
    dist = tmp_path / "api_plug_bad-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: api-plug-bad\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fedmosaic.plugins]\nbad = api_plug_bad\n")
    assert main(["list", "models"]) == 0  # a broken package stops no command that does not need it
    out, err = capsys.readouterr()
    assert "mlp" in out and err == ("fedmosaic: warning: plugin 'api_plug_bad' (entry point 'bad' of api-plug-bad): "
                                    "cannot import it: ZeroDivisionError: division by zero; continuing without it\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BLOBS6, "model": {"name": "bad_net"}}))
    assert main(["run", str(cfg), "--check"]) == 2  # a name it would have registered: the reason is said there
    err = capsys.readouterr().err
    assert "unknown 'bad_net' (plugin 'api_plug_bad' (entry point 'bad' of api-plug-bad): cannot import it" in err
    assert err.count("\n") == 1 and "warning" not in err  # warned once a process


@pytest.mark.parametrize("plugin, message", [
    ("api_no_such_module", ("plugin 'api_no_such_module': cannot import it: ModuleNotFoundError: No module "
                            "named 'api_no_such_module'")),
    ("api_broken", "plugin 'api_broken': cannot import it: ZeroDivisionError: division by zero"),
    ("./my_plugin.py", "plugin './my_plugin.py': give the module's name (my_plugin), not its file"),
])
def test_a_plugin_that_cannot_be_imported_is_one_line_naming_it(plugin, message, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "api_broken.py").write_text("import fedmosaic\n1 / 0\n")
    assert main(["--plugin", plugin, "list", "models"]) == 2
    err = capsys.readouterr().err
    assert err == f"fedmosaic: error: {message}\n"


def test_an_exception_in_a_plugins_code_is_blamed_on_it_not_on_fedmosaic(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "api_buggy.py").write_text(
        "import torch\nfrom torch import nn\nimport fedmosaic\n\n\n"
        "class Buggy(nn.Module):\n"
        "    def __init__(self, input_shape, num_classes):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(36, num_classes)\n\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            {}['missing']\n"
        "        return self.fc(x.flatten(1))\n\n\n"
        "fedmosaic.register_model('api_buggy', Buggy)\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**BLOBS6, "model": {"name": "api_buggy"}, "train": {**BLOBS6["train"], "rounds": 1}}))
    assert main(["--plugin", "api_buggy", "run", str(cfg), "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fedmosaic: error in plug-in code (api_buggy.py:13 in forward): KeyError: 'missing'"), err
    assert "bug in fedmosaic" not in err


def test_a_run_read_without_its_plugin_names_it(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "meta.json").write_text(json.dumps({"plugins": ["api_absent_plugin"]}))
    monkeypatch.setattr(plugins, "RECORDED", {})
    with pytest.raises(ConfigError) as e:
        build_model("api_absent_model", (4,), 2)
    assert "(registered in Python? pass its module: --plugin MODULE)" in str(e.value)  # nothing known: how to
    plugins.expect([tmp_path])
    with pytest.raises(ConfigError) as e:
        build_model("api_absent_model", (4,), 2)
    assert str(e.value).startswith("model.name: unknown 'api_absent_model' (the run was made with plugin "
                                   "api_absent_plugin: pass --plugin api_absent_plugin); allowed:")
    (tmp_path / "run" / "meta.json").write_text(json.dumps({"plugins": ["__main__"]}))  # registered by a script
    plugins.expect([tmp_path])
    with pytest.raises(ConfigError, match=r"unknown dataset 'api_absent' \(the run was made with a dataset that a "
                                          r"script registered: move its register_dataset call into a module and pass "
                                          r"--plugin MODULE\)"):
        fedmosaic.run({"data": {"dataset": "api_absent"}}, tmp_path / "never", progress=False)


# ---- the README's "Write your own algorithm": its code, executed as written ------------------------------------
def _readme_section(title: str) -> list[tuple[str, str]]:
    readme = (REPO / "README.md").read_text()
    section = re.search(rf"^## {re.escape(title)}$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section, f"README.md has no '## {title}' section"
    return re.findall(r"```(\w*)\n(.*?)```", section.group(1), re.S)


def test_the_readmes_own_algorithm_registers_reduces_to_fedavg_and_runs_from_the_cli(tmp_path, monkeypatch, capsys):
    import importlib

    from fedmosaic.cli.main import main
    from fedmosaic.protocol.algorithm import ALGORITHMS

    blocks = _readme_section("Write your own algorithm")
    (code,) = [b for lang, b in blocks if lang == "python"]
    (command,) = [b.strip() for lang, b in blocks if lang in ("sh", "bash")]
    (tmp_path / "my_algorithm.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("my_algorithm")
        small = {**SMALL, "train": {**SMALL["train"], "rounds": 2}}
        mine = fedmosaic.compare(small, ["server_step", "fedavg", "server_step:eta_g=1.5,mu=0.1"], tmp_path / "c",
                                 progress=False)
        assert mine[0].metrics[-1]["global"] == mine[1].metrics[-1]["global"]  # eta_g 1, mu 0: FedAvg exactly
        assert mine[2].metrics[-1]["global"] != mine[1].metrics[-1]["global"]
        assert set(mine[2].metrics[-1]["terms"]) == {"task_loss", "prox"}
        assert json.loads((mine[0].dir / "meta.json").read_text())["plugins"] == ["my_algorithm"]
        # read back where the plug-in is not imported: an error naming it, then with it
        ALGORITHMS.pop("server_step")
        sys.modules.pop("my_algorithm")
        with pytest.raises(ConfigError, match=r"unknown 'server_step' \(the run was made with plugin my_algorithm: "
                                              r"pass plugins=\['my_algorithm'\]\)"):
            fedmosaic.api.Result.load(mine[0].dir)
        again = fedmosaic.api.Result.load(mine[0].dir, plugins="my_algorithm")  # (one name alone too)
        assert again.summary == mine[0].summary and again.accuracy == mine[0].accuracy
        # the README's command line, with its rounds cut
        argv = command.split()[1:] + ["--set", "train.rounds=1", "--no-progress", "--out", str(tmp_path / "cli")]
        assert main(argv) == 0, capsys.readouterr().err
        assert "server_step(eta_g=1.5)" in capsys.readouterr().out
    finally:
        ALGORITHMS.pop("server_step", None)
        sys.modules.pop("my_algorithm", None)
        plugins.ORIGINS.pop(("algorithm", "server_step"), None)
        plugins.RECORDED.clear()


def test_result_accuracy_is_what_the_method_is_judged_by(tmp_path):
    both = fedmosaic.compare(SMALL, ["fedavg", "ditto"], tmp_path / "c", progress=False)
    fedavg, ditto = both
    assert fedavg.accuracy == fedavg.summary["global_acc_final"]
    assert ditto.accuracy == ditto.summary["personal_acc_final"] != ditto.summary["global_acc_final"]
