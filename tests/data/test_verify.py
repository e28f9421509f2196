"""`fedmosaic data list --verify`: SHA256SUMS files and registry pins, against small data folders made in tmp_path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from conftest import NO_SHARED_DATA, SHARED_DATA

from fedmosaic.cli.main import main
from fedmosaic.data.registry import REGISTRY, DatasetSpec, Layout, Source
from fedmosaic.data.verify import parse_sums
from fedmosaic.paths import set_data_dirs


@pytest.fixture(autouse=True)
def _only_given_data_dirs(monkeypatch):
    """Leave out /usr/share/datasets (a machine may have Debian's Fashion-MNIST there); reset --data-dir after."""
    import fedmosaic.data.registry
    import fedmosaic.data.verify
    import fedmosaic.paths

    def given() -> list[Path]:
        return [d for d in fedmosaic.paths.data_dirs() if d != Path("/usr/share/datasets")]

    monkeypatch.setattr(fedmosaic.data.registry, "data_dirs", given)
    monkeypatch.setattr(fedmosaic.data.verify, "data_dirs", given)
    yield
    set_data_dirs(None)  # (main() restores it itself; a test that sets it directly may not)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sums_line(path: Path, base: Path, binary: bool = False) -> str:
    return f"{sha(path)} {'*' if binary else ' '}./{path.relative_to(base).as_posix()}\n"


@pytest.fixture
def data(tmp_path) -> Path:
    """usps (two files) and mnist (a tiny keras npz) in tmp_path/data, a root SHA256SUMS listing all three."""
    root = tmp_path / "data"
    (root / "usps").mkdir(parents=True)
    (root / "mnist").mkdir()
    rng = np.random.default_rng(0)
    for name in ("zip.train.gz", "zip.test.gz"):
        (root / "usps" / name).write_bytes(rng.bytes(3000))
    x, y = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.arange(4, dtype=np.uint8)
    np.savez(root / "mnist" / "mnist.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    (root / "SHA256SUMS").write_text(
        "# made by the test\n\n"
        + sums_line(root / "usps" / "zip.train.gz", root)
        + sums_line(root / "usps" / "zip.test.gz", root, binary=True)
        + sums_line(root / "mnist" / "mnist.npz", root)
    )
    return root


def verify(root: Path, capsys) -> tuple[int, str, str]:
    status = main(["--data-dir", str(root), "data", "list", "--verify"])
    out, err = capsys.readouterr()
    return status, out, err


def verdict(out: str, name: str) -> str:
    below = out.split("\nverify:", 1)[1]  # the verification block, after the usual list
    return next(line for line in below.splitlines() if line.startswith(f"{name} "))


def test_intact_files_pass(data, capsys):
    assert main(["--data-dir", str(data), "data", "list"]) == 0  # without --verify: the usual list, no hashing
    plain, err = capsys.readouterr()
    assert "\nverify:" not in plain and "mnist" in plain and err == ""
    status, out, err = verify(data, capsys)
    assert status == 0, err
    assert out.startswith(plain + "\n")  # --verify adds its block after the unchanged list
    assert f"verify: SHA-256 against {data / 'SHA256SUMS'}" in out
    assert verdict(out, "usps").split()[1:4] == ["ok", "2", "files"]
    # the test npz is not the canonical Keras file: its pin differs, but SHA256SUMS vouches for it
    assert "ok        1 file checked (1 not the pinned download" in verdict(out, "mnist")
    assert "BAD" not in out + err and "MISSING" not in out + err


def test_one_flipped_byte_fails_and_names_the_file(data, capsys):
    target = data / "usps" / "zip.test.gz"
    blob = bytearray(target.read_bytes())
    expected = sha(target)
    blob[1234] ^= 0x01
    target.write_bytes(bytes(blob))
    status, out, err = verify(data, capsys)
    assert status == 1
    assert "FAILED    2 files checked: 1 BAD, 1 ok" in verdict(out, "usps")
    bad = [line for line in err.splitlines() if "BAD" in line]
    assert bad == [f"fedmosaic: BAD {target} (sha256 {sha(target)[:12]}…, expected {expected[:12]}… "
                   f"by {data / 'SHA256SUMS'}:4)"]
    assert verdict(out, "mnist").startswith("mnist              ok")


def test_deleted_file_is_missing(data, capsys):
    """Deleting a listed file makes usps not found, yet the SHA256SUMS entry still names it as missing."""
    (data / "usps" / "zip.train.gz").unlink()
    status, out, err = verify(data, capsys)
    assert status == 1
    assert f"fedmosaic: MISSING {data / 'usps' / 'zip.train.gz'} (listed in {data / 'SHA256SUMS'}:3)" in err
    assert "1 MISSING, 1 ok; dataset not found" in verdict(out, "usps")


def test_missing_file_under_a_layout_directory(tmp_path, capsys):
    """femnist's LEAF layout is two directories: every listed file under them counts, unlisted ones are unchecked."""
    root = tmp_path / "data"
    for split in ("train", "test"):
        (root / "femnist" / split).mkdir(parents=True)
        for i in range(2):
            (root / "femnist" / split / f"part{i}.json").write_text(f'{{"split": "{split}", "i": {i}}}')
    listed = [root / "femnist" / "train" / "part0.json", root / "femnist" / "train" / "part1.json",
              root / "femnist" / "test" / "part0.json"]
    (root / "SHA256SUMS").write_text("".join(sums_line(p, root) for p in listed))
    status, out, _ = verify(root, capsys)
    assert status == 0
    assert "ok        3 files checked; 1 unchecked (in no SHA256SUMS)" in verdict(out, "femnist")

    listed[1].unlink()  # the dataset is still found (its directories exist), the file is missing
    status, out, err = verify(root, capsys)
    assert status == 1
    assert f"fedmosaic: MISSING {listed[1]}" in err
    assert "3 files checked: 1 MISSING, 2 ok; 1 unchecked" in verdict(out, "femnist")


def test_malformed_line_is_reported_with_its_line_number(data, capsys):
    sums = data / "SHA256SUMS"
    lines = sums.read_text().splitlines(keepends=True)
    lines.insert(3, "not-a-hash  ./usps/zip.test.gz\n")  # becomes line 4
    lines.append("d41d8cd98f00b204e9800998ecf8427e  ./mnist/mnist.npz\n")  # an MD5 is not a SHA-256: line 7
    sums.write_text("".join(lines))
    status, out, err = verify(data, capsys)
    assert status == 1
    assert f"fedmosaic: {sums}:4: malformed line 'not-a-hash  ./usps/zip.test.gz'" in err
    assert f"fedmosaic: {sums}:7: malformed line 'd41d8cd98f00b204e9800998ecf8427e  ./mnist/mnist.npz'" in err
    assert "Traceback" not in err
    assert verdict(out, "usps").startswith("usps               ok")  # the well-formed lines are still checked


def test_per_dataset_folder_sums(data, capsys):
    """<folder>/SHA256SUMS, paths relative to that folder, with or without ./ and in binary mode."""
    (data / "SHA256SUMS").unlink()
    usps = data / "usps"
    (usps / "SHA256SUMS").write_text(f"{sha(usps / 'zip.train.gz')}  zip.train.gz\n"
                                     f"{sha(usps / 'zip.test.gz')} *./zip.test.gz\n")
    status, out, err = verify(data, capsys)
    assert status == 0, err
    assert f"verify: SHA-256 against {usps / 'SHA256SUMS'}" in out
    assert "ok        2 files checked" in verdict(out, "usps")
    assert verdict(out, "mnist").split()[1] == "warning"  # no SHA256SUMS for it: only its pin, which differs

    (usps / "zip.train.gz").write_bytes(b"replaced")
    status, out, err = verify(data, capsys)
    assert status == 1
    assert f"fedmosaic: BAD {usps / 'zip.train.gz'} " in err and f"by {usps / 'SHA256SUMS'}:1)" in err


def test_unreadable_file_is_named_not_a_traceback(data, capsys):
    """A listed path that cannot be read (here a directory; tests run as root, so chmod would not do)."""
    sums = data / "SHA256SUMS"
    (data / "usps" / "extra").mkdir()
    sums.write_text(sums.read_text() + f"{'0' * 64}  ./usps/extra\n")
    status, _, err = verify(data, capsys)
    assert status == 1
    assert f"fedmosaic: UNREADABLE {data / 'usps' / 'extra'} (not a regular file)" in err


def test_a_fifo_does_not_block_verification(data, capsys):
    """Opening a FIFO for reading blocks until a writer comes: it is refused before it is opened."""
    import os

    fifo = data / "usps" / "pipe"
    os.mkfifo(fifo)
    sums = data / "SHA256SUMS"
    sums.write_text(sums.read_text() + f"{'0' * 64}  ./usps/pipe\n")
    status, _, err = verify(data, capsys)
    assert status == 1 and f"fedmosaic: UNREADABLE {fifo} (not a regular file)" in err


def test_registry_pin_is_checked(tmp_path, monkeypatch, capsys):
    """Without any SHA256SUMS: one line says so; a pinned download is still compared with its pin."""
    root = tmp_path / "data"
    (root / "pinned").mkdir(parents=True)
    blob = b"the canonical bytes"
    (root / "pinned" / "a.bin").write_bytes(blob)
    spec = DatasetSpec("pinned-test", "pinned", (Layout("bin", ("a.bin",), lambda folder: None),),
                       downloads=(Source("a.bin", "file:///nowhere", hashlib.sha256(blob).hexdigest()),))
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    status, out, err = verify(root, capsys)
    assert status == 0 and err == ""
    assert out.count("no SHA256SUMS in") == 1 and "nothing checked against checksum files" in out
    assert "ok        1 file checked" in verdict(out, "pinned-test")

    (root / "pinned" / "a.bin").write_bytes(b"repackaged bytes")
    status, out, err = verify(root, capsys)
    assert status == 0  # a pin describes the canonical download; other copies may differ legitimately
    assert "warning   1 file checked: 1 differs from the download pin" in verdict(out, "pinned-test")
    assert f"fedmosaic: warning: {root / 'pinned' / 'a.bin'} differs from the registry's download pin" in err


def test_parse_sums_formats(tmp_path):
    sums = tmp_path / "SHA256SUMS"
    h = "AB" * 32
    sums.write_text(f"  # comment\n{h}  ./a/b.txt\n{h} *c.bin\r\n\nSHA256 (./d e.txt) = {h}\n{h}\tx\n")
    parsed = parse_sums(sums)
    assert [(e.path, e.sha256, e.where) for e in parsed.entries] == [
        (tmp_path / "a" / "b.txt", h.lower(), f"{sums}:2"),
        (tmp_path / "c.bin", h.lower(), f"{sums}:3"),
        (tmp_path / "d e.txt", h.lower(), f"{sums}:5"),
    ]
    assert len(parsed.problems) == 1 and parsed.problems[0].startswith(f"{sums}:6: malformed line")


@pytest.mark.skipif(not (SHARED_DATA / "SHA256SUMS").is_file(), reason=NO_SHARED_DATA)
def test_shared_data_verifies(capsys):
    """The real data folder (~240 MB hashed, a few seconds): every dataset there matches its SHA256SUMS."""
    status, out, err = verify(SHARED_DATA, capsys)
    assert status == 0, err
    assert f"verify: SHA-256 against {SHARED_DATA / 'SHA256SUMS'}" in out
    for name in ("cifar10", "cifar100", "femnist", "mnist", "office-caltech10", "tiny-imagenet", "usps", "vehicle"):
        assert verdict(out, name).split()[1] == "ok", verdict(out, name)
    # cifar10-gray reads CIFAR-10's files: they are verified once, under cifar10
    assert not any(line.startswith("cifar10-gray ") for line in out.split("\nverify:", 1)[1].splitlines())
