"""Dataset loaders: real data in ../shared/data (and Debian's Fashion-MNIST), each reader on tiny files."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from conftest import NO_SHARED_DATA, need_data
from PIL import Image

from fedmosaic.data import load_dataset
from fedmosaic.data.datasets import cifar
from fedmosaic.data.datasets._io import read_idx
from fedmosaic.data.registry import dataset_names, get_spec
from fedmosaic.errors import CorruptDataError, DataNotFoundError

# the `shared` folder beside the repository root (CI clones the repo with ../shared/ next to it)
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
rng = np.random.default_rng(0)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, cache_dir):
    """No test writes to the user's real cache; one cache for the session, so slow decodes happen once."""
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(cache_dir))


@pytest.fixture
def shared(monkeypatch) -> Path:
    if not SHARED.is_dir():
        pytest.skip(NO_SHARED_DATA)
    monkeypatch.setenv("FEDMOSAIC_DATA", str(SHARED))
    return SHARED


@pytest.fixture
def data_dir(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("FEDMOSAIC_DATA", str(tmp_path))
    return tmp_path


def check_images(d, shape, n_train, n_test, n_classes, per_class=None, builtin=False):
    for x, y, n in ((d.x_train, d.y_train, n_train), (d.x_test, d.y_test, n_test)):
        assert x.shape == (n, *shape) and x.dtype == np.uint8 and x.flags.c_contiguous
        assert y.shape == (n,) and y.dtype == np.int64
        assert y.min() >= 0 and y.max() < n_classes
    assert d.num_classes == n_classes
    assert builtin or d.source_files
    assert all(Path(f).is_absolute() and Path(f).exists() for f in d.source_files)
    if per_class is not None:
        train_counts, test_counts = per_class
        assert np.bincount(d.y_train, minlength=n_classes).tolist() == train_counts
        assert np.bincount(d.y_test, minlength=n_classes).tolist() == test_counts


def channel_means(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=(0, 2, 3))


# ---------------------------------------------------------------- real data


def test_mnist_real(shared):
    d = load_dataset("mnist")
    check_images(d, (1, 28, 28), 60000, 10000, 10, (
        [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
        [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
    ))
    assert channel_means(d.x_train) == pytest.approx([0.1307 * 255], abs=0.1)  # the well-known MNIST mean


def test_fashion_mnist_real():
    need_data("fashion-mnist")  # not among the offline copies: Debian's package or a download
    d = load_dataset("fmnist")
    assert d.name == "fashion-mnist" and d.classes[0] == "T-shirt/top"
    check_images(d, (1, 28, 28), 60000, 10000, 10, ([6000] * 10, [1000] * 10))
    assert channel_means(d.x_train) == pytest.approx([0.2860 * 255], abs=0.1)


def test_usps_real(shared):
    d = load_dataset("usps")
    check_images(d, (1, 16, 16), 7291, 2007, 10, (
        [1194, 1005, 731, 658, 652, 556, 664, 645, 542, 644],
        [359, 264, 198, 166, 200, 160, 170, 147, 166, 177],
    ))
    assert d.x_train.min() == 0 and d.x_train.max() == 255


def test_femnist_real(shared):
    d = load_dataset("femnist")
    check_images(d, (1, 28, 28), 14708, 1685, 62)
    assert len(d.group_names) == 105 and "subset" in d.meta
    assert set(np.unique(d.groups_train)) == set(np.unique(d.groups_test)) == set(range(105))
    assert len(np.unique(d.y_train)) == 62
    assert np.median(d.x_train) == 255  # LEAF convention: mostly white background


def test_office_caltech10_real(shared):
    d = load_dataset("office-caltech10")
    assert d.x_train.shape == (2533, 800) and d.x_train.dtype == np.float32
    assert d.y_train.dtype == np.int64 and d.x_test is None and d.y_test is None
    assert d.group_names == ["amazon", "caltech", "dslr", "webcam"]
    assert np.bincount(d.groups_train).tolist() == [958, 1123, 157, 295]
    for g in range(4):
        assert np.unique(d.y_train[d.groups_train == g]).tolist() == list(range(10))


def test_vehicle_real(shared):
    d = load_dataset("vehicle")
    assert d.x_train.shape == (1860, 100) and d.x_train.dtype == np.float32
    assert np.unique(d.y_train).tolist() == [0, 1] and d.classes == ["-1", "+1"]
    assert len(d.group_names) == 23 and np.unique(d.groups_train).tolist() == list(range(23))
    assert d.x_test is None and "test_split" in d.meta


@pytest.mark.slow  # decodes 60k JPEGs
def test_cifar10_real_and_cache(shared, cache_dir, monkeypatch):
    d = load_dataset("cifar10")
    check_images(d, (3, 32, 32), 50000, 10000, 10, ([5000] * 10, [1000] * 10))
    assert d.classes == "airplane automobile bird cat deer dog frog horse ship truck".split()
    assert "jpeg q75" in d.meta["lossy"]
    assert channel_means(d.x_train) == pytest.approx([125.3, 123.0, 113.9], abs=1.0)  # RGB order, CHW
    assert list((cache_dir / "decoded").glob("cifar10-jpeg-q75-*.npz"))
    monkeypatch.setattr(cifar, "read_image_splits", fail)  # the second load must not decode again
    again = load_dataset("cifar10")
    assert np.array_equal(again.x_train, d.x_train) and np.array_equal(again.y_test, d.y_test)


@pytest.mark.slow
def test_cifar10_gray_real(shared):
    # runs after test_cifar10_real_and_cache, so the decoded JPEGs come from the session cache
    d, rgb = load_dataset("cifar10-gray"), load_dataset("cifar10")
    check_images(d, (1, 32, 32), 50000, 10000, 10, ([5000] * 10, [1000] * 10))
    assert d.name == "cifar10-gray" and d.classes == rgb.classes and "luma" in d.meta["greyscale"]
    assert np.array_equal(d.y_train, rgb.y_train) and np.array_equal(d.y_test, rgb.y_test)
    # bit-identical to PIL's RGB -> L conversion (ITU-R 601-2 luma), on a spread of real images
    for i in (0, 1, 12345, 49999):
        pil = np.asarray(Image.fromarray(rgb.x_train[i].transpose(1, 2, 0)).convert("L"))
        assert np.array_equal(d.x_train[i, 0], pil)
    pil = np.asarray(Image.fromarray(rgb.x_test[-1].transpose(1, 2, 0)).convert("L"))
    assert np.array_equal(d.x_test[-1, 0], pil)
    assert get_spec("cifar10-grey") is get_spec("cifar10-gray")
    assert get_spec("cifar10-gray").variant_of == "cifar10"


def test_luma_matches_pil_on_every_colour_corner():
    from fedmosaic.data.datasets._variants import luma

    vals = np.array([0, 1, 127, 128, 254, 255], dtype=np.uint8)
    r, g, b = np.meshgrid(vals, vals, vals, indexing="ij")
    img = np.stack([r, g, b], -1).reshape(1, -1, 3)  # HWC with H = 1
    expected = np.asarray(Image.fromarray(img).convert("L"))
    assert np.array_equal(luma(img.transpose(2, 0, 1)[None])[0, 0], expected)
    with pytest.raises(ValueError, match="RGB"):
        luma(np.zeros((2, 1, 4, 4), np.uint8))


@pytest.mark.slow
def test_cifar100_real(shared):
    d = load_dataset("cifar100")
    check_images(d, (3, 32, 32), 50000, 10000, 100, ([500] * 100, [100] * 100))
    assert d.classes[:3] == ["apple", "aquarium_fish", "baby"] and "test_order" in d.meta
    assert channel_means(d.x_train) == pytest.approx([129.3, 124.1, 112.4], abs=1.0)


@pytest.mark.slow
def test_tiny_imagenet_real(shared):
    d = load_dataset("tiny-imagenet")
    check_images(d, (3, 64, 64), 10000, 10000, 200, ([50] * 200, [50] * 200))
    assert d.classes == sorted(d.classes) and d.classes[0] == "n01443537"
    assert "50 train images per class" in d.meta["subset"]
    small = load_dataset("tiny-imagenet-32")  # the 32x32 variant: the same samples, resized
    check_images(small, (3, 32, 32), 10000, 10000, 200, ([50] * 200, [50] * 200))
    assert np.array_equal(small.y_train, d.y_train) and "32x32" in small.meta["resized"]
    # a 2x downsampling of a constant image is that constant: the mean colour of every image barely moves
    assert np.abs(small.x_train[:50].mean((2, 3)) - d.x_train[:50].mean((2, 3))).max() < 1.0


def test_svhn_real():
    need_data("svhn")  # not among the offline copies (its reader is tested below on a tiny file)
    check_images(load_dataset("svhn"), (3, 32, 32), 73257, 26032, 10)


def test_digits_builtin(data_dir):
    d = load_dataset("digits")
    check_images(d, (1, 8, 8), 1437, 360, 10, builtin=True)
    assert d.x_train.max() == 255 and "derived_test" in d.meta
    assert np.bincount(d.y_test).min() >= 35  # stratified: ~36 of each digit
    assert np.array_equal(load_dataset("digits").x_test, d.x_test)  # the split is fixed


def test_digits_are_sklearns_split_as_sklearn_makes_it_read_without_importing_sklearn(data_dir):
    """The shipped split order is scikit-learn's train_test_split(stratify, seed 0) of its load_digits; reading the
    digits (a deployed node does at every message) imports neither scikit-learn nor SciPy."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    b = load_digits()
    x = np.rint(b.images * (255 / 16)).astype(np.uint8)[:, None]
    x_train, x_test, y_train, y_test = train_test_split(x, b.target, test_size=0.2, stratify=b.target, random_state=0)
    d = load_dataset("digits")
    for ours, theirs in ((d.x_train, x_train), (d.x_test, x_test), (d.y_train, y_train), (d.y_test, y_test)):
        assert np.array_equal(ours, theirs)
    code = ("import sys; from fedmosaic.data import load_dataset; load_dataset('digits'); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_registry_names_and_alias():
    get_spec("mnist")  # importing the loaders registers them
    assert set(dataset_names()) - {"blobs"} == {  # blobs: the test suite's own registered dataset
        "mnist", "fashion-mnist", "cifar10", "cifar100", "usps", "femnist", "office-caltech10", "vehicle",
        "tiny-imagenet", "svhn", "digits", "cinic10", "cifar10-gray", "mnist-m", "syn", "digits-domains",
        "digits-offline", "office-caltech10-images", "tiny-imagenet-32",
    }
    assert get_spec("FMNIST") is get_spec("fashion-mnist")


def test_missing_dataset_names_expected_files(data_dir):
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("svhn")
    msg = str(err.value)
    assert "train_32x32.mat" in msg and "test_32x32.mat" in msg and str(data_dir) in msg and "\n" not in msg


# ---------------------------------------------------------------- readers on tiny generated files


def fail(*args, **kwargs):
    raise AssertionError("decoded again instead of using the cache")


def write_idx(path: Path, a: np.ndarray, code: int = 0x08) -> None:
    header = bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    raw = header + a.astype(a.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def tiny_digits(n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.uint8)


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_mnist_idx_layout(data_dir, suffix):
    (data_dir / "mnist").mkdir()
    (x, y), (xt, yt) = tiny_digits(5), tiny_digits(3)
    for stem, a in (("train-images-idx3-ubyte", x), ("train-labels-idx1-ubyte", y),
                    ("t10k-images-idx3-ubyte", xt), ("t10k-labels-idx1-ubyte", yt)):
        write_idx(data_dir / "mnist" / (stem + suffix), a)
    d = load_dataset("mnist")
    assert np.array_equal(d.x_train[:, 0], x) and np.array_equal(d.y_test, yt)
    assert d.x_test.shape == (3, 1, 28, 28)


def test_mnist_keras_npz(data_dir):
    (data_dir / "mnist").mkdir()
    (x, y), (xt, yt) = tiny_digits(4), tiny_digits(2)
    np.savez(data_dir / "mnist" / "mnist.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    d = load_dataset("mnist")
    assert np.array_equal(d.x_train[:, 0], x) and d.y_train.tolist() == y.tolist()


def test_read_idx_big_endian_ints(tmp_path):
    a = np.arange(-3, 3, dtype=np.int32).reshape(2, 3)
    write_idx(tmp_path / "a.idx", a, code=0x0C)
    assert np.array_equal(read_idx(tmp_path / "a.idx"), a)


def write_cifar_pickles(folder: Path, classes: int, label_key: bytes, files: dict[str, int], meta: tuple):
    folder.mkdir(parents=True)
    data = {}
    for name, n in files.items():
        x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        y = rng.integers(0, classes, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": x, label_key: y}, f, protocol=2)  # like the official python-2 pickles
        data[name] = (x.reshape(-1, 3, 32, 32), y)
    with open(folder / meta[0], "wb") as f:
        pickle.dump({meta[1]: [f"c{i}".encode() for i in range(classes)]}, f, protocol=2)
    return data


def test_cifar10_python_pickles(data_dir):
    files = {f"data_batch_{i}": 2 for i in range(1, 6)} | {"test_batch": 3}
    meta = ("batches.meta", b"label_names")
    data = write_cifar_pickles(data_dir / "cifar-10-batches-py", 10, b"labels", files, meta)
    d = load_dataset("cifar10")
    assert d.x_train.shape == (10, 3, 32, 32) and d.classes == [f"c{i}" for i in range(10)]
    assert np.array_equal(d.x_train[2:4], data["data_batch_2"][0])
    assert d.y_test.tolist() == data["test_batch"][1]
    grey = load_dataset("cifar10-gray")  # the variant reads every CIFAR-10 layout
    assert grey.x_train.shape == (10, 1, 32, 32) and grey.y_test.tolist() == data["test_batch"][1]


def test_cifar100_python_pickles(data_dir):
    data = write_cifar_pickles(data_dir / "cifar-100-python", 100, b"fine_labels", {"train": 4, "test": 2},
                               ("meta", b"fine_label_names"))
    d = load_dataset("cifar100")
    assert np.array_equal(d.x_test, data["test"][0]) and d.y_train.tolist() == data["train"][1]


def test_cifar_pickle_refuses_code(data_dir):
    write_cifar_pickles(data_dir / "cifar-100-python", 100, b"fine_labels", {"train": 1, "test": 1},
                        ("meta", b"fine_label_names"))
    (data_dir / "cifar-100-python" / "test").write_bytes(pickle.dumps({b"data": print}, protocol=2))
    with pytest.raises(CorruptDataError, match=r"refusing to load \S*print"):
        load_dataset("cifar100")


def test_cifar100_npz_hwc_to_chw(data_dir):
    (data_dir / "cifar-100").mkdir()
    x, xt = (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for n in (3, 2))
    names = np.array([f"class{i}" for i in range(100)])
    np.savez(data_dir / "cifar-100" / "cifar100_train.npz", x_train=x, y_train=np.array([0, 5, 99], np.uint8),
             fine_label_names=names)
    np.savez(data_dir / "cifar-100" / "cifar100_test.npz", x_test=xt, y_test=np.array([1, 2], np.uint8))
    d = load_dataset("cifar100")
    assert np.array_equal(d.x_train, x.transpose(0, 3, 1, 2)) and d.y_train.tolist() == [0, 5, 99]
    assert d.classes == names.tolist()


def png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def image_tree(classes=("dog", "cat"), per_class=2, size=32) -> dict[str, np.ndarray]:
    """``train|test/<class>/<n>.png`` names -> HWC pixels, written out of order to test the sorting."""
    return {f"{split}/{c}/{i:04d}.png": rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for split in ("test", "train") for c in classes for i in reversed(range(per_class))}


def expected_split(tree: dict[str, np.ndarray], split: str) -> np.ndarray:
    return np.stack([tree[n] for n in sorted(tree) if n.startswith(split)]).transpose(0, 3, 1, 2)


def test_cifar10_image_folders(data_dir):
    tree = image_tree()
    for name, a in tree.items():
        (data_dir / "cifar10" / name).parent.mkdir(parents=True, exist_ok=True)
        (data_dir / "cifar10" / name).write_bytes(png(a))
    d = load_dataset("cifar10")
    assert d.classes == ["cat", "dog"] and d.y_train.tolist() == [0, 0, 1, 1]
    assert np.array_equal(d.x_train, expected_split(tree, "train"))
    assert np.array_equal(d.x_test, expected_split(tree, "test"))


def write_tarball(path: Path, files: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def test_cifar10_tarball_is_cached(data_dir, cache_dir, monkeypatch):
    tree = image_tree(classes=("b", "a", "c"))
    path = data_dir / cifar.CIFAR10_TARBALL
    write_tarball(path, {"README.md": b"not an image"} | {n: png(a) for n, a in tree.items()})
    d = load_dataset("cifar10")
    assert d.classes == ["a", "b", "c"] and np.array_equal(d.x_train, expected_split(tree, "train"))
    assert d.source_files == [str(path.resolve())] and "lossy" in d.meta
    with monkeypatch.context() as m:
        m.setattr(cifar, "read_image_splits", fail)
        assert np.array_equal(load_dataset("cifar10").x_test, d.x_test)
    # a replaced tarball (new size/mtime) is decoded again, and its stale cache entry is dropped
    tree = image_tree(classes=("x",), per_class=1)
    write_tarball(path, {n: png(a) for n, a in tree.items()})
    assert load_dataset("cifar10").classes == ["x"]
    assert len(list((cache_dir / "decoded").glob(f"cifar10-jpeg-q75-{'?' * 16}.npz"))) == 1


def test_image_folder_unknown_test_class(data_dir):
    tree = image_tree(per_class=1)
    tree["test/cow/0000.png"] = tree.pop("test/dog/0000.png")
    write_tarball(data_dir / cifar.CIFAR10_TARBALL, {n: png(a) for n, a in tree.items()})
    with pytest.raises(CorruptDataError, match="cow"):
        load_dataset("cifar10")


def test_usps_text(data_dir):
    (data_dir / "usps").mkdir()
    values = np.full((2, 256), -1.0)
    values[0, 0], values[0, 1], values[1, 255] = 1.0, 0.0, 1.0
    for name, labels in (("zip.train.gz", [3, 7]), ("zip.test.gz", [0, 9])):
        rows = "\n".join(" ".join(f"{v:.4f}" for v in [lab, *row]) for lab, row in zip(labels, values))
        (data_dir / "usps" / name).write_bytes(gzip.compress(rows.encode() + b"\n"))
    d = load_dataset("usps")
    assert d.y_train.tolist() == [3, 7] and d.x_train.shape == (2, 1, 16, 16)
    assert d.x_train[0, 0, 0, :3].tolist() == [255, 128, 0] and d.x_test[1, 0, 15, 15] == 255


def test_svhn_mat(data_dir):
    (data_dir / "svhn").mkdir()
    x = rng.integers(0, 256, (32, 32, 3, 4), dtype=np.uint8)
    for name in ("train_32x32.mat", "test_32x32.mat"):
        scipy.io.savemat(data_dir / "svhn" / name, {"X": x, "y": np.array([[10], [1], [9], [10]], np.uint8)})
    d = load_dataset("svhn")
    check_images(d, (3, 32, 32), 4, 4, 10)
    assert d.y_train.tolist() == [0, 1, 9, 0]
    assert d.x_train[2, 1, 5, 7] == x[5, 7, 1, 2]  # (H, W, C, N) -> (N, C, H, W)


def leaf_json(users: dict[str, tuple[np.ndarray, list]]) -> str:
    return json.dumps({
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.tolist(), "y": y} for u, (x, y) in users.items()},
    })


def test_femnist_json_and_npz_agree(data_dir, tmp_path_factory, monkeypatch):
    pixels = rng.integers(0, 256, (5, 784)).astype(np.uint8)
    labels = [0, 61, 10, 36, 5]
    for split, users in (("train", {"w_b": (pixels[:2], labels[:2]), "w_a": (pixels[2:3], labels[2:3])}),
                         ("test", {"w_a": (pixels[3:], labels[3:])})):
        (data_dir / "femnist" / split).mkdir(parents=True)
        as_float = {u: (x / 255.0, y) for u, (x, y) in users.items()}
        (data_dir / "femnist" / split / "all_data_0.json").write_text(leaf_json(as_float))
    from_json = load_dataset("femnist")
    assert from_json.group_names == ["w_a", "w_b"] and from_json.classes[36] == "a"
    assert from_json.groups_train.tolist() == [0, 1, 1] and from_json.groups_test.tolist() == [0, 0]
    assert np.array_equal(from_json.x_train.reshape(3, 784), pixels[[2, 0, 1]])

    other = tmp_path_factory.mktemp("npz")
    (other / "femnist").mkdir()
    np.savez(other / "femnist" / "femnist_leaf_niid05_105writers.npz",
             x_train=from_json.x_train[:, 0], y_train=from_json.y_train, writer_train=from_json.groups_train,
             x_test=from_json.x_test[:, 0], y_test=from_json.y_test, writer_test=from_json.groups_test,
             writers=np.array(from_json.group_names))
    monkeypatch.setenv("FEDMOSAIC_DATA", str(other))
    from_npz = load_dataset("femnist")
    for field in ("x_train", "y_train", "groups_train", "x_test", "y_test", "groups_test", "group_names"):
        assert np.array_equal(getattr(from_npz, field), getattr(from_json, field)), field
    assert from_npz.meta["pixels"] == from_json.meta["pixels"]


def test_vehicle_with_test_file(data_dir):
    (data_dir / "vehicle").mkdir()
    x = rng.normal(size=(5, 100)).astype(np.float32)
    (data_dir / "vehicle" / "mytrain.json").write_text(
        leaf_json({"s1": (x[:2], [[-1], [1]]), "s0": (x[2:3], [[1]])}))
    (data_dir / "vehicle" / "mytest.json").write_text(leaf_json({"s0": (x[3:], [[-1], [-1]])}))
    d = load_dataset("vehicle")
    assert d.group_names == ["s1", "s0"] and d.groups_test.tolist() == [1, 1]
    assert d.y_train.tolist() == [0, 1, 1] and d.y_test.tolist() == [0, 0] and "test_split" not in d.meta
    assert np.allclose(d.x_test, x[3:])


def test_office_surf_and_images(data_dir):
    (data_dir / "office-caltech10-surf").mkdir()
    for i, domain in enumerate(("amazon", "caltech", "dslr", "webcam")):
        labels = np.array([[1], [10], [i + 1]], np.uint8)
        scipy.io.savemat(data_dir / "office-caltech10-surf" / f"{domain}.mat",
                         {"feas": np.full((3, 800), i, np.float64), "label": labels})
    d = load_dataset("office-caltech10")
    assert d.x_train.shape == (12, 800) and d.x_train[4, 0] == 1.0 and d.y_train[:3].tolist() == [0, 9, 0]
    assert d.groups_train.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3

    (data_dir / "office-caltech10-surf").rename(data_dir / "unused")
    for i, domain in enumerate(("amazon", "caltech", "dslr", "webcam")):
        folder = data_dir / "office-caltech10" / domain / ("mug" if i % 2 else "bike")
        folder.mkdir(parents=True)
        (folder / "frame_0001.jpg").write_bytes(png(np.full((60, 80, 3), 40 * i, np.uint8)))  # content is PNG
    d = load_dataset("office-caltech10")
    assert d.x_train.shape == (4, 3, 32, 32) and d.classes == ["bike", "mug"] and d.x_test is None
    assert d.y_train.tolist() == [0, 1, 0, 1] and d.groups_train.tolist() == [0, 1, 2, 3]
    assert d.x_train[3].min() == d.x_train[3].max() == 120


def jpeg(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def tiny_imagenet_files() -> dict[str, bytes]:
    """Two classes, two train images each (one greyscale), and a val set listed out of name order."""
    wnids = ["n02", "n01"]
    files = {"wnids.txt": "\n".join(wnids).encode() + b"\n"}
    for k, w in enumerate(wnids):
        for i in range(2):
            grey, rgb = np.full((64, 64), 100 + 50 * k, np.uint8), np.full((64, 64, 3), 30, np.uint8)
            files[f"train/{w}/images/{w}_{i}.JPEG"] = jpeg(grey if i else rgb)
        files[f"train/{w}/{w}_boxes.txt"] = b""
    files["val/images/val_0.JPEG"] = jpeg(np.full((64, 64, 3), 200, np.uint8))
    files["val/images/val_1.JPEG"] = jpeg(np.full((64, 64, 3), 0, np.uint8))
    files["val/val_annotations.txt"] = b"val_1.JPEG\tn01\t0\t0\t1\t1\nval_0.JPEG\tn02\t0\t0\t1\t1\n"
    files["test/images/test_0.JPEG"] = jpeg(np.zeros((64, 64, 3), np.uint8))  # unlabelled: ignored
    return files


def check_tiny_imagenet(d) -> None:
    check_images(d, (3, 64, 64), 4, 2, 2)
    assert d.classes == ["n01", "n02"] and d.y_train.tolist() == [0, 0, 1, 1] and d.y_test.tolist() == [0, 1]
    grey = d.x_train[1]
    assert np.array_equal(grey[0], grey[1]) and np.array_equal(grey[1], grey[2])  # greyscale became RGB
    assert np.abs(d.x_test[1].astype(int) - 200).max() <= 2 and "subset" in d.meta


def test_tiny_imagenet_zip_and_folder(data_dir):
    folder = data_dir / "tiny-imagenet-200"
    folder.mkdir()
    with zipfile.ZipFile(folder / "tiny-imagenet-200.zip", "w") as z:
        for name, blob in tiny_imagenet_files().items():
            z.writestr(f"tiny-imagenet-200/{name}", blob)
    from_zip = load_dataset("tiny-imagenet")
    check_tiny_imagenet(from_zip)

    (folder / "tiny-imagenet-200.zip").unlink()
    for name, blob in tiny_imagenet_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(blob)
    from_folder = load_dataset("tiny-imagenet")
    check_tiny_imagenet(from_folder)
    assert np.array_equal(from_folder.x_train, from_zip.x_train)


# ---------------------------------------------------------------- corrupt files


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def corrupt_mnist_npz(d: Path) -> Path:
    (x, y), (xt, yt) = tiny_digits(50), tiny_digits(5)
    np.savez_compressed(d / "mnist" / "mnist.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    return d / "mnist" / "mnist.npz"


def corrupt_idx(d: Path) -> Path:
    x, y = tiny_digits(50)
    for stem in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        write_idx(d / "mnist" / f"{stem}.gz", x)
    for stem in ("train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"):
        write_idx(d / "mnist" / f"{stem}.gz", y)
    return d / "mnist" / "train-images-idx3-ubyte.gz"


def corrupt_svhn(d: Path) -> Path:
    (d / "svhn").mkdir()
    for name in ("train_32x32.mat", "test_32x32.mat"):
        x = rng.integers(0, 256, (32, 32, 3, 20), dtype=np.uint8)
        scipy.io.savemat(d / "svhn" / name, {"X": x, "y": np.ones((20, 1), np.uint8)})
    return d / "svhn" / "test_32x32.mat"


def corrupt_tarball(d: Path) -> Path:
    tree = image_tree(per_class=20)
    write_tarball(d / cifar.CIFAR10_TARBALL, {n: png(a) for n, a in tree.items()})
    return d / cifar.CIFAR10_TARBALL


def corrupt_json(d: Path) -> Path:
    (d / "vehicle").mkdir()
    (d / "vehicle" / "mytrain.json").write_text(leaf_json({"s0": (np.zeros((3, 100)), [1, -1, 1])}))
    return d / "vehicle" / "mytrain.json"


@pytest.mark.parametrize("name, make", [
    ("mnist", corrupt_mnist_npz), ("mnist", corrupt_idx), ("svhn", corrupt_svhn),
    ("cifar10", corrupt_tarball), ("vehicle", corrupt_json),
])
def test_truncated_file_is_reported_by_name(data_dir, name, make):
    (data_dir / "mnist").mkdir()
    path = make(data_dir)
    truncate(path)
    with pytest.raises(CorruptDataError) as err:
        load_dataset(name)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_leaf_labels_wrong_count(data_dir):
    (data_dir / "vehicle").mkdir()
    doc = {"users": ["s0"], "num_samples": [2], "user_data": {"s0": {"x": [[0.0] * 100] * 2, "y": [1]}}}
    (data_dir / "vehicle" / "mytrain.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptDataError, match=r"mytrain\.json"):
        load_dataset("vehicle")

