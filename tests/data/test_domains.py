"""Domain-shift data: MNIST-M and SynthDigits loaders and the Digits composites on small files generated here, the
one-line error naming a missing domain, the per-domain private sizes, and public images from another dataset."""

from __future__ import annotations

import gzip
import io
import zipfile

import numpy as np
import pytest
import scipy.io
from PIL import Image

from fedmosaic.data import load_dataset
from fedmosaic.data.federated import PartitionSpec, compute
from fedmosaic.data.public import public_images
from fedmosaic.errors import ConfigError, DataNotFoundError


@pytest.fixture(autouse=True)
def data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDMOSAIC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "data"


def png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def write_mnist(d, n=6):
    (d / "mnist").mkdir(parents=True)
    x = np.zeros((n, 28, 28), np.uint8)
    x[:, 10:18, 10:18] = 200
    np.savez(d / "mnist" / "mnist.npz", x_train=x, y_train=np.arange(n) % 10, x_test=x[:2], y_test=np.array([1, 2]))


def write_usps(d):
    (d / "usps").mkdir(parents=True)
    for name, labels in (("zip.train.gz", [3, 7, 1]), ("zip.test.gz", [0])):
        rows = "\n".join(" ".join(f"{v:.4f}" for v in [lab, *np.full(256, 1.0)]) for lab in labels)
        (d / "usps" / name).write_bytes(gzip.compress(rows.encode() + b"\n"))


def write_mat(d, folder, names, n=4):
    (d / folder).mkdir(parents=True)
    x = np.random.default_rng(0).integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
    for name in names:
        scipy.io.savemat(d / folder / name, {"X": x, "y": (np.arange(n)[:, None] % 10 + 1).astype(np.uint8)})


def write_mnistm_zip(d):
    (d / "mnist-m").mkdir(parents=True)
    with zipfile.ZipFile(d / "mnist-m" / "mnist_m_subset.zip", "w") as z:
        for split, n in (("train", 3), ("test", 2)):
            for i in range(n):
                z.writestr(f"{split}/{i % 2}/{i:08d}.png", png(np.full((32, 32, 3), 50 * i, np.uint8)))


def test_mnist_m_zip_and_syn_mat(data_dir):
    write_mnistm_zip(data_dir)
    d = load_dataset("mnist-m")
    assert d.x_train.shape == (3, 3, 32, 32) and d.y_train.tolist() == [0, 0, 1] and d.y_test.tolist() == [0, 1]
    write_mat(data_dir, "syn", ("synth_train_32x32.mat", "synth_test_32x32.mat"))
    s = load_dataset("syn")
    assert s.x_train.shape == (4, 3, 32, 32) and s.y_train.tolist() == [1, 2, 3, 4]


def test_digits_composites_are_32x32_rgb_with_one_group_per_domain(data_dir):
    write_mnist(data_dir)
    write_usps(data_dir)
    write_mnistm_zip(data_dir)
    d = load_dataset("digits-offline")
    assert d.x_train.shape == (6 + 3 + 3, 3, 32, 32) and d.x_test.shape == (2 + 1 + 2, 3, 32, 32)
    assert d.groups_train.tolist() == [0] * 6 + [1] * 3 + [2] * 3 and d.groups_test.tolist() == [0, 0, 1, 2, 2]
    assert d.group_names == ["mnist", "usps", "mnist-m"]
    mnist = d.x_train[0]
    assert np.array_equal(mnist[0], mnist[1]) and np.array_equal(mnist[1], mnist[2])  # grey repeated
    assert mnist[0, 0, 0] == 0 and mnist[0, 16, 16] == 200  # 28 -> 32: the square stays where it was
    assert (d.x_train[6:9] == 255).all()  # USPS's 1.0 is white, resized 16 -> 32
    with pytest.raises(DataNotFoundError, match="dataset 'svhn' not found: put train_32x32.mat"):
        load_dataset("digits-domains")
    write_mat(data_dir, "svhn", ("train_32x32.mat", "test_32x32.mat"))
    with pytest.raises(DataNotFoundError, match="dataset 'syn' not found: put synth_train_32x32.mat"):
        load_dataset("digits-domains")
    write_mat(data_dir, "syn", ("synth_train_32x32.mat", "synth_test_32x32.mat"))
    four = load_dataset("digits-domains")
    assert four.group_names == ["mnist", "usps", "svhn", "syn"] and four.x_train.shape[1:] == (3, 32, 32)


def test_domains_partition_keeps_the_private_sizes(data_dir):
    write_mnist(data_dir)
    write_usps(data_dir)
    write_mnistm_zip(data_dir)
    spec = PartitionSpec("digits-offline", None, {"scheme": "domains", "sizes": [4, 2, 9], "test_sizes": [1, 5, 1]})
    fd = compute(spec, load_dataset("digits-offline"))
    assert fd.sizes("train").tolist() == [4, 2, 3] and fd.sizes("test").tolist() == [1, 1, 1]
    groups = np.concatenate([fd.dataset.groups_train, fd.dataset.groups_test])
    for split in ("train", "test"):  # every client's samples come from its own domain
        for k in range(3):
            lo, hi = fd.ptr[split][k], fd.ptr[split][k + 1]
            assert (groups[fd.src[split][lo:hi]] == k).all()
    with pytest.raises(ConfigError, match="one size per domain, 3 domains"):
        compute(PartitionSpec("digits-offline", None, {"scheme": "domains", "sizes": [4, 2]}),
                load_dataset("digits-offline"))


def test_public_images_take_the_private_shape(data_dir):
    write_mnistm_zip(data_dir)
    g = np.random.default_rng(0)
    grey = public_images("mnist-m", 2, (1, 16, 16), g)
    assert grey.shape == (2, 1, 16, 16) and grey.dtype == np.uint8
    write_mnist(data_dir)
    rgb = public_images("mnist", 3, (3, 32, 32), g)
    assert rgb.shape == (3, 3, 32, 32) and np.array_equal(rgb[:, 0], rgb[:, 2])
    with pytest.raises(ConfigError, match="has 6 train images"):
        public_images("mnist", 7, (3, 32, 32), g)
    with pytest.raises(ConfigError, match="not an image dataset"):
        public_images("mnist", 2, (800,), g)


def test_office_images_by_their_own_name_even_beside_the_surf_files(data_dir):
    (data_dir / "office-caltech10-surf").mkdir(parents=True)
    for domain in ("amazon", "caltech", "dslr", "webcam"):
        scipy.io.savemat(data_dir / "office-caltech10-surf" / f"{domain}.mat",
                         {"feas": np.zeros((2, 800)), "label": np.array([[1], [2]], np.uint8)})
    with pytest.raises(DataNotFoundError, match="office-caltech10/amazon/"):
        load_dataset("office-caltech10-images")
    for i, domain in enumerate(("amazon", "caltech", "dslr", "webcam")):
        folder = data_dir / "office-caltech10" / domain / "mug"
        folder.mkdir(parents=True)
        (folder / "frame_0001.jpg").write_bytes(png(np.full((40, 50, 3), 30 * i, np.uint8)))
    d = load_dataset("office-caltech10-images")
    assert d.x_train.shape == (4, 3, 32, 32) and d.groups_train.tolist() == [0, 1, 2, 3]
    assert load_dataset("office-caltech10").x_train.shape == (8, 800)  # the SURF layout still comes first
