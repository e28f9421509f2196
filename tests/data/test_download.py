"""Downloads, offline: sources are file:// URLs to files made in tmp_path."""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fedmosaic.data import ArrayDataset, load_dataset
from fedmosaic.data.download import download_dataset, download_file
from fedmosaic.data.registry import REGISTRY, DatasetSpec, Layout, Source, get_spec
from fedmosaic.errors import CorruptDataError, DataNotFoundError


@pytest.fixture
def remote(tmp_path) -> Path:
    (tmp_path / "remote").mkdir()
    return tmp_path / "remote"


@pytest.fixture
def data_dir(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("FEDMOSAIC_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def serve(remote: Path, name: str, blob: bytes, sha256: str | None = "auto") -> Source:
    (remote / name).write_bytes(blob)
    digest = hashlib.sha256(blob).hexdigest() if sha256 == "auto" else sha256
    return Source(name, (remote / name).as_uri(), digest)


def tarball(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, blob in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return buf.getvalue()


def test_download_verified(remote, tmp_path):
    src = serve(remote, "a.bin", b"payload" * 1000)
    target = download_file(src, tmp_path / "dest")
    assert target == tmp_path / "dest" / "a.bin" and target.read_bytes() == b"payload" * 1000
    assert [p.name for p in target.parent.iterdir()] == ["a.bin"]  # no temp file left beside it


def test_download_without_pinned_hash(remote, tmp_path):
    assert download_file(serve(remote, "b.txt", b"x", sha256=None), tmp_path).read_bytes() == b"x"


def test_hash_mismatch_leaves_nothing(remote, tmp_path):
    src = serve(remote, "a.bin", b"tampered", sha256="0" * 64)
    with pytest.raises(CorruptDataError) as err:
        download_file(src, tmp_path / "dest")
    msg = str(err.value)
    assert str(tmp_path / "dest" / "a.bin") in msg and "0" * 64 in msg and "\n" not in msg
    assert hashlib.sha256(b"tampered").hexdigest() in msg
    assert not (tmp_path / "dest").exists()  # (nor the folder made for it: no empty dataset folder left)


def test_missing_source_is_data_not_found(remote, tmp_path):
    src = Source("gone.bin", (remote / "gone.bin").as_uri())
    with pytest.raises(DataNotFoundError) as err:
        download_file(src, tmp_path / "dest")
    assert src.url in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "dest").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(DataNotFoundError):  # a folder that was there stays, with what it holds
        download_file(src, tmp_path / "mine" / "sub")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep.txt"]


def fake_spec(downloads: tuple[Source, ...], files: tuple[str, ...]) -> DatasetSpec:
    def read(folder: Path) -> ArrayDataset:
        x = np.frombuffer((folder / files[0]).read_bytes(), np.uint8).reshape(-1, 1)
        return ArrayDataset("fake", x, np.zeros(len(x), np.int64), None, None, ["0"])

    return DatasetSpec(name="fake", folder="fake", layouts=(Layout("raw", files, read),), downloads=downloads)


def test_load_dataset_downloads_and_unpacks_tarball(remote, data_dir, monkeypatch):
    src = serve(remote, "fake.tar.gz", tarball({"pkg/data.bin": b"\x01\x02\x03"}))
    monkeypatch.setitem(REGISTRY, "fake", fake_spec((src,), ("pkg/data.bin",)))
    with pytest.raises(DataNotFoundError):
        load_dataset("fake")  # download is opt-in
    d = load_dataset("fake", download=True)
    assert d.x_train.ravel().tolist() == [1, 2, 3]
    # nothing else left behind (no temp folder)
    assert sorted(p.name for p in (data_dir / "fake").iterdir()) == ["fake.tar.gz", "pkg"]


def test_unpack_replaces_an_incomplete_copy(remote, data_dir):
    src = serve(remote, "fake.tar.gz", tarball({"pkg/data.bin": b"\x07"}))
    (data_dir / "fake" / "pkg").mkdir(parents=True)
    (data_dir / "fake" / "pkg" / "partial.bin").write_bytes(b"")
    download_dataset(fake_spec((src,), ("pkg/data.bin",)))
    assert [p.name for p in (data_dir / "fake" / "pkg").iterdir()] == ["data.bin"]


def test_unsafe_tarball_is_refused(remote, data_dir):
    src = serve(remote, "evil.tar.gz", tarball({"../escaped.txt": b"x"}))
    with pytest.raises(CorruptDataError, match="unsafe member"):
        download_dataset(fake_spec((src,), ("data.bin",)))
    assert not (data_dir / "escaped.txt").exists()


def test_builtin_sources_are_well_formed():
    names = ["mnist", "fashion-mnist", "cifar10", "cifar100", "usps", "svhn", "tiny-imagenet"]
    for name in names:
        spec = get_spec(name)
        assert spec.downloads, name
        for src in spec.downloads:
            assert re.fullmatch(r"https?://\S+/" + re.escape(src.filename), src.url), src.url
            assert src.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", src.sha256), src
