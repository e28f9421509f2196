"""FederatedData on real data: hashes, cache, save/load, the partition CLI and its error paths."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import need_data
from fedtest import HANG_S, time_limit

import fedmosaic.data.federated as federated
from fedmosaic.cli.main import main
from fedmosaic.data.federated import FederatedData, PartitionSpec, build
from fedmosaic.errors import FedMosaicError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def partition(tmp_path, name, *args):
    out = tmp_path / name
    assert main(["partition", *args, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_mnist_dirichlet_cli_summary_png_and_stable_hash(tmp_path, capsys):
    need_data("mnist")
    args = ("--dataset", "mnist", "--clients", "100", "--scheme", "dirichlet", "--alpha", "0.1", "--seed", "0")
    a = partition(tmp_path, "a", *args)
    first = capsys.readouterr().out
    assert "clients      100" in first and "entropy" in first and "median" in first
    assert (a / "partition.png").read_bytes()[:8] == PNG_MAGIC
    b = partition(tmp_path, "b", *args)
    second = capsys.readouterr().out
    hash_of = lambda text: next(l for l in text.splitlines() if l.startswith("hash")).split()[-1]  # noqa: E731
    assert hash_of(first) == hash_of(second)
    partition(tmp_path, "c", *args[:-1], "1")
    assert hash_of(capsys.readouterr().out) != hash_of(first)
    fa, fb = FederatedData.load(a), FederatedData.load(b)
    assert fa.hash == fb.hash and fa.num_clients == 100
    assert all(np.array_equal(fa.src[s], fb.src[s]) for s in ("train", "test"))


def test_dirichlet_alpha_001_with_1000_clients_terminates(tmp_path, capsys):
    need_data("mnist")
    with time_limit(HANG_S):  # bounded retries, then a repair: a hang fails instead of blocking CI
        out = partition(tmp_path, "d", "--dataset", "mnist", "--clients", "1000", "--scheme", "dirichlet",
                        "--alpha", "0.01")
    fd = FederatedData.load(out)
    assert fd.sizes().min() >= 10 and fd.sizes().sum() == 60000


def test_apfl_mnist_generator_matches_paper_total_and_mean():
    """APFL/FedProx table: 1000 clients, 69,035 samples, mean 69 (std: see docs/results.md)."""
    need_data("mnist")
    fd = build(PartitionSpec("mnist", None, {"scheme": "apfl_mnist"}, "all", 0.1, 0.0, 0))
    sizes = fd.sizes("train") + fd.sizes("test")
    assert fd.num_clients == 1000
    assert sizes.sum() == pytest.approx(69035, rel=0.1)
    assert sizes.mean() == pytest.approx(69, rel=0.1)
    # every user holds exactly its two digits, 90/10 split per user
    counts = fd.summary("train")["counts"]
    u = np.arange(1000)
    assert (counts[u, u % 10] > 0).all() and (counts[u, (u + 1) % 10] > 0).all()
    assert ((counts > 0).sum(1) == 2).all()
    # FedProx keeps int(0.9 n) for training, so small users hold out a little more than 10%
    assert fd.sizes("test").sum() == pytest.approx(0.1 * sizes.sum(), rel=0.1)


def test_cache_is_reused_and_invalid_partition_dirs_are_refused(tmp_path, monkeypatch):
    need_data("usps")
    spec = PartitionSpec("usps", 20, {"scheme": "shards", "shards_per_client": 2}, seed=4)
    first = build(spec)
    monkeypatch.setattr(federated, "compute", lambda *a: pytest.fail("recomputed instead of loading the cache"))
    again = build(spec)
    assert again.hash == first.hash
    # shards also shard the test set with the same label table
    test_labels = [set(np.unique(again.client(k, "test")[1])) for k in range(20)]
    train_labels = [set(np.unique(again.client(k, "train")[1])) for k in range(20)]
    assert test_labels == train_labels


def test_save_never_replaces_a_different_partition(tmp_path):
    a = build(PartitionSpec("digits", 10, {"scheme": "iid"}, seed=0))
    b = build(PartitionSpec("digits", 10, {"scheme": "iid"}, seed=1))
    a.save(tmp_path / "p")
    before = (tmp_path / "p" / "partition.npz").read_bytes()
    with pytest.raises(FedMosaicError, match="different partition"):
        b.save(tmp_path / "p")
    assert (tmp_path / "p" / "partition.npz").read_bytes() == before
    a.save(tmp_path / "p")  # the identical partition is fine
    (tmp_path / "p" / "partition.npz").write_bytes(before[:100])  # damaged: it said saved over it, unread
    a.save(tmp_path / "p")
    assert (tmp_path / "p" / "partition.npz").read_bytes() == before  # written anew, the damaged one kept aside
    assert (tmp_path / "p" / "partition.npz.corrupt").read_bytes() == before[:100]


def test_two_saves_into_one_new_folder_at_once_keep_one_partition_and_refuse_the_other(tmp_path):
    """Two `partition` commands to one new --out both said saved, the folder holding one's manifest and data and the
    other's plot. save() now holds the folder: the second waits, then finds the first's partition and is refused.
    (The first here: its files copied in while the test holds the folder, as another process would write them.)"""
    import fcntl
    import os
    import shutil
    import threading

    a = build(PartitionSpec("digits", 10, {"scheme": "iid"}, seed=0))
    b = build(PartitionSpec("digits", 10, {"scheme": "iid"}, seed=1))
    a.save(tmp_path / "a")
    d = tmp_path / "p"
    d.mkdir()
    lock = os.open(d, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    got: list = []
    # the second starts while the first is between its two files (the order save() writes them in: it once
    # judged the folder before holding it, and called such a partition "not a partition folder" under load)
    shutil.copy(tmp_path / "a" / "partition.npz", d / "partition.npz")
    second = threading.Thread(target=lambda: got.append(_raised(lambda: b.save(d))))
    second.start()
    try:
        shutil.copy(tmp_path / "a" / "manifest.json", d / "manifest.json")
    finally:
        os.close(lock)
    second.join(timeout=60)
    assert not second.is_alive() and isinstance(got[0], FedMosaicError) and "different partition" in str(got[0])
    assert (d / "partition.npz").read_bytes() == (tmp_path / "a" / "partition.npz").read_bytes()


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (what the thread raised, for the test to judge)
        return e
    return None


def test_views_not_copies_and_client_ranges():
    fd = build(PartitionSpec("digits", 10, {"scheme": "dirichlet", "alpha": 0.5}, client_test=0.25, seed=0))
    x, y = fd.client(3)
    assert np.shares_memory(x, fd.x["train"])
    assert len(x) == fd.sizes()[3] and fd.ptr["train"][-1] == len(fd.y["train"])
    assert fd.sizes("test").sum() > 0 and fd.x_global is not None


@pytest.mark.parametrize("args, needle", [
    (["--dataset", "mnist", "--clients", "10", "--scheme", "dirichlet", "--alpha", "-1"], "partition.alpha"),
    (["--dataset", "mnist", "--clients", "10", "--scheme", "label_k", "--k", "11"], "k"),
    (["--dataset", "imagenet21k", "--clients", "10"], "unknown dataset 'imagenet21k'"),
    (["--dataset", "mnist", "--clients", "10", "--scheme", "voronoi"], "partition.scheme: unknown 'voronoi'"),
    (["--dataset", "digits", "--clients", "5000", "--scheme", "iid"], "--clients: 5000 clients"),
    (["--dataset", "digits", "--clients", "500", "--scheme", "shards", "--shards", "10"], "shards"),
    (["--dataset", "digits", "--scheme", "dirichlet"], "--clients: required for partition scheme 'dirichlet'"),
    (["--dataset", "digits", "--clients", "0"], "argument --clients: must be an integer >= 1 (got '0')"),
    (["--dataset", "digits", "--clients", "5", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["--dataset", "digits", "--clients", "5", "--test-frac", "nan"], "argument --test-frac: must be a number in"),
    (["--dataset", "digits", "--clients", "5", "--classes", "a,b"], "--classes 'a,b': expected class ids"),
    (["--dataset", "digits", "--clients", "5", "--alpha", "inf"], "partition.alpha: must be a finite number"),
    (["--dataset", "digits", "--clients", "5", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_partition_errors_are_one_line(args, needle, tmp_path, capsys):
    assert main(["partition", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_partition_out_that_is_a_file(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("user data")
    assert main(["partition", "--dataset", "digits", "--clients", "3", "--out", str(taken)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err and taken.read_text() == "user data"


def test_partition_out_never_overwrites_what_it_did_not_write(tmp_path, capsys):
    args = ["partition", "--dataset", "digits", "--clients", "3", "--out"]
    for name, content, needle in [("manifest.json", "garbage", "holds an unreadable manifest.json"),
                                  ("partition.npz", "mine", "holds a partition.npz without a manifest.json"),
                                  ("partition.png", "mine", "holds 'partition.png' and is not a partition")]:
        d = tmp_path / name
        d.mkdir()
        (d / name).write_text(content)
        assert main([*args, str(d)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
        assert [p.name for p in d.iterdir()] == [name] and (d / name).read_text() == content
    # the same partition again: a missing file is written again, the rest is kept
    d = tmp_path / "same"
    assert main([*args, str(d)]) == 0
    (d / "partition.npz").unlink()
    png = (d / "partition.png").stat().st_mtime_ns
    assert main([*args, str(d)]) == 0
    assert (d / "partition.npz").exists() and (d / "partition.png").stat().st_mtime_ns == png


def test_partition_out_refuses_a_folder_that_is_not_a_partition(tmp_path, capsys, monkeypatch):
    """A non-empty folder of the user's is refused in one line before the data are read; its files are
    untouched (``notes.tmp`` too: it is not a temporary file of ours). One that holds only what a killed save
    left is ours."""
    args = ["partition", "--dataset", "digits", "--clients", "3", "--out"]
    with monkeypatch.context() as m:
        m.setattr(federated, "build", lambda *a, **k: pytest.fail("the data were read first"))
        for names in (["notes.tmp"], ["thesis.tex", "data"]):
            d = tmp_path / names[0]
            d.mkdir()
            for name in names:
                (d / name).write_text("mine")
            assert main([*args, str(d)]) == 2
            err = capsys.readouterr().err
            assert f"already holds {min(names)!r}" in err and "choose another --out" in err
            assert err.count("\n") == 1
            assert sorted(p.name for p in d.iterdir()) == sorted(names)
        (tmp_path / "link").symlink_to(tmp_path / "gone")  # dangling: refused at once too, nothing made there
        assert main([*args, str(tmp_path / "link")]) == 2
        assert "link is a symbolic link to" in capsys.readouterr().err and not (tmp_path / "gone").exists()
    d = tmp_path / "killed"
    d.mkdir()
    (d / ".partition.npz.a1b2c3d4.tmp").write_bytes(b"half")
    assert main([*args, str(d)]) == 0
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "partition.npz", "partition.png"]


@pytest.mark.slow
def test_entry_point_reports_errors_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fedmosaic.cli.main", "partition", "--dataset", "mnist",
                        "--clients", "10", "--scheme", "dirichlet", "--alpha", "0"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "partition.alpha" in r.stderr
