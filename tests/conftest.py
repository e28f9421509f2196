"""Shared fixtures. Tests read real data from ../shared/data beside the repository (as CI has it) and from
where this user's `fedmosaic data download` puts datasets; a test whose dataset is in neither skips, saying
how to get it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fedmosaic.paths import data_dirs

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()
# read before any test changes the environment: the user's own search path (FEDMOSAIC_DATA, else the download
# folder), so a dataset fetched with `fedmosaic data download` is found; Debian's /usr/share/datasets is last
DATA_PATH = os.pathsep.join(dict.fromkeys(map(str, [SHARED_DATA, *data_dirs()])))
#: the reason of a test that checks the offline copies themselves (their subsets, their sizes)
NO_SHARED_DATA = (f"the project's offline dataset copies are not at {SHARED_DATA} (../shared/data beside the "
                  "checkout, as .ci/run expects)")
#: Debian packages that install a dataset into /usr/share/datasets
DEBIAN_PACKAGES = {"fashion-mnist": "dataset-fashion-mnist"}
# one CPU thread for every run a test makes, in this process and in the ones it starts, unless the caller says
# otherwise: the default follows the machine's load at each run's start (engine/client/threads.py: cpu_threads), and tests
# that compare a run in one process with its resumption in another need the same count in both
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the device the suite's runs take for `engine.device: auto`: the CPU (whose numbers the tests pin) unless
# FEDMOSAIC_TEST_DEVICE says otherwise (e.g. `FEDMOSAIC_TEST_DEVICE=cuda python -m pytest` on a GPU machine)
os.environ["FEDMOSAIC_DEVICE"] = os.environ.get("FEDMOSAIC_TEST_DEVICE", "cpu")

#: the files that take longest (minutes of real deployments, Ray runtimes, the CLI fuzz), longest first. They are
#: collected first, so that the full suite's `-n 2 --dist loadfile --no-loadscope-reorder` starts them first and
#: the many short files fill the end evenly, instead of starting them last (xdist's default order: the files with
#: the most tests first), where one of them alone decided when the suite ended.
LONG_FILES = ["deploy/test_flower.py", "deploy/test_flower_recovery.py", "scale/test_ray_pool.py",
              "test_fuzz_cli.py", "deploy/test_prepare.py", "engine/test_precision.py", "scale/test_ray_cluster.py",
              "test_recovery.py", "test_kill9.py"]


def pytest_collection_modifyitems(config, items):
    rank = {f"tests/{f}": i for i, f in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))  # (stable: the rest in order)


@pytest.fixture(autouse=True)
def _isolated(request, monkeypatch, tmp_path_factory):
    """Every test sees the shared data and a private cache, never the user's; a test marked ``cpu`` (a formula
    checked by hand on host tensors, or the CPU's own execution choices) runs on the CPU whatever
    FEDMOSAIC_TEST_DEVICE says."""
    monkeypatch.setenv("FEDMOSAIC_DATA", os.environ.get("FEDMOSAIC_TEST_DATA", DATA_PATH))
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    if request.node.get_closest_marker("cpu"):
        monkeypatch.setenv("FEDMOSAIC_DEVICE", "cpu")


def need_data(name: str) -> None:
    """Skip the calling test unless the dataset is on the data search path, with a reason that says how to get
    it (a fresh machine has neither ../shared/data nor Debian's dataset packages)."""
    from fedmosaic.data.registry import find_layout, get_spec

    spec = get_spec(name)
    if find_layout(spec) is None:
        how = [f"`fedmosaic data download {spec.name}`"] if spec.downloads else []
        if spec.name in DEBIAN_PACKAGES:
            how.append(f"`apt-get install {DEBIAN_PACKAGES[spec.name]}`")
        get = f"get it with {' or '.join(how)}" if how else "`fedmosaic data list` names the files it needs"
        pytest.skip(f"dataset {spec.name} not found (searched {os.environ['FEDMOSAIC_DATA']}): {get}")


def blobs(n_train=600, n_test=200, classes=5, shape=(1, 6, 6), seed=0):
    """A small learnable image dataset: class-dependent means plus noise, as uint8."""
    from fedmosaic.data.base import ArrayDataset

    rng = np.random.default_rng(seed)
    centers = rng.uniform(40, 215, size=(classes, *shape))

    def draw(n):
        y = rng.integers(0, classes, n)
        x = np.clip(centers[y] + rng.normal(0, 30, size=(n, *shape)), 0, 255).astype(np.uint8)
        return x, y.astype(np.int64)

    xtr, ytr = draw(n_train)
    xte, yte = draw(n_test)
    return ArrayDataset("blobs", xtr, ytr, xte, yte, [f"c{i}" for i in range(classes)])


def _register_blobs():
    """Users plug in their own data the same way: a DatasetSpec whose reader returns an ArrayDataset."""
    from fedmosaic.data.registry import REGISTRY, DatasetSpec, Layout, register

    if "blobs" not in REGISTRY:
        register(DatasetSpec("blobs", ".", (Layout("generated", (), lambda folder: blobs()),), builtin=True))


_register_blobs()


@pytest.fixture(scope="session")
def blob_data():
    return blobs()


@pytest.fixture(scope="session")
def ray_runtime(tmp_path_factory):
    """One local Ray runtime for the session's scale-out tests (tests/scale): 2 CPUs, a small object store, no
    dashboard, no usage statistics, no token file in the home directory; stopped at the end, and every process it
    started that outlives ``ray.shutdown`` killed by PID."""
    import ray
    from scale.raytools import RAY_ENV, descendants, kill

    os.environ.update(RAY_ENV)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        yield ray
    finally:
        started = set(descendants(os.getpid()))
        ray.shutdown()
        kill(started & set(descendants(os.getpid())))  # what ray.shutdown left running


@pytest.fixture
def bounded():
    """The test runs at most 240 s: an alarm interrupts it (in the main thread; Ray's waits are interruptible)."""
    import signal

    def stop(signum, frame):
        raise TimeoutError("the test took more than 240 s")

    before = signal.signal(signal.SIGALRM, stop)
    signal.alarm(240)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
