"""Augmentation ops, the forgetting score, and the compare command's algorithm specs."""

import numpy as np
import pytest
import torch

from fedmosaic.config import algorithm_spec
from fedmosaic.engine.client import augment
from fedmosaic.engine.client.augment import AugmentConfig
from fedmosaic.errors import FedMosaicError
from fedmosaic.runs.records import forgetting


def test_crop_flip_cutout_match_a_hand_made_example():
    x = torch.arange(1.0, 17.0).reshape(1, 1, 4, 4)  # no zero pixel: zeros are holes or padding
    # crop with padding 1: offsets (0, 2) shift the window up by one row and right by one column
    p = torch.tensor([[0, 2, 0, 0, 0]])
    out = augment.apply(AugmentConfig(crop_padding=1), x, p)
    expected = torch.zeros(4, 4)
    expected[1:, :3] = x[0, 0, :3, 1:]
    assert torch.equal(out[0, 0], expected)
    flipped = augment.apply(AugmentConfig(flip=True), x, torch.tensor([[0, 0, 1, 0, 0]]))
    assert torch.equal(flipped[0, 0], x[0, 0].flip(-1))
    holed = augment.apply(AugmentConfig(cutout=2), x, torch.tensor([[0, 0, 0, 2, 1]]))
    hole = holed[0, 0] == 0
    assert hole.sum() == 4 and hole[1:3, 0:2].all()  # rows cy-1..cy, cols cx-1..cx


def test_channel_normalisation_takes_channels_first_images_and_normalises_other_shapes_per_feature():
    from fedmosaic.engine.client.transforms import make_normalizer

    rng = np.random.default_rng(0)
    seq = rng.normal(3.0, 2.0, size=(64, 4, 5)).astype(np.float32)  # (T, F) per sample: per feature
    norm = make_normalizer("channel", seq, "cpu")
    assert norm.mean.shape == (4, 5) and torch.allclose(norm.mean, torch.as_tensor(seq.mean(0)), atol=1e-5)
    grey = rng.integers(0, 256, size=(8, 6, 6), dtype=np.uint8)  # uint8 (H, W): one grey channel
    norm = make_normalizer("channel", grey, "cpu")
    assert norm.mean.numel() == 1 and float(norm.mean) == pytest.approx(grey.mean() / 255, rel=1e-6)
    vol = rng.integers(0, 256, size=(4, 2, 3, 4, 4), dtype=np.uint8)  # (C, D, H, W): per channel
    norm = make_normalizer("channel", vol, "cpu")
    assert norm.mean.shape == (2, 1, 1, 1)
    assert torch.allclose(norm.mean.flatten(), torch.as_tensor(vol.mean((0, 2, 3, 4)) / 255, dtype=torch.float32))


def test_crop_pads_with_black_not_with_the_mean():
    """FedNTD crops before normalising: the padding is black, i.e. (0 - mean) / std once normalised."""
    from fedmosaic.engine.client.transforms import make_normalizer

    raw = np.full((2, 3, 4, 4), 200, dtype=np.uint8)
    raw[1] = 50
    norm = make_normalizer("channel", raw, "cpu")
    fill = augment.black(norm, (3, 4, 4), "cpu")
    assert torch.allclose(fill.flatten(), (0 - norm.mean.flatten()) / norm.std.flatten())
    x = norm(torch.as_tensor(raw[:1]))
    out = augment.apply(AugmentConfig(crop_padding=1), x, torch.tensor([[0, 0, 0, 0, 0]]), fill)
    assert torch.allclose(out[0, :, 0, :], fill[:, 0, :].expand(3, 4))  # the padded top row
    assert torch.allclose(out[0, :, 1:, 1:], x[0, :, :3, :3])  # the image, shifted


def test_draws_depend_on_client_not_on_cohort():
    cfg = AugmentConfig(crop_padding=4, flip=True, cutout=16)
    a = augment.draw(cfg, np.array([3, 7]), np.array([9, 5]), 8, (3, 32, 32), seed=1, round_idx=2)
    b = augment.draw(cfg, np.array([7]), np.array([5]), 8, (3, 32, 32), seed=1, round_idx=2)
    assert torch.equal(a[:5, 1], b[:, 0])
    assert a[..., :2].max() <= 8 and a[..., 2].max() <= 1


def test_forgetting_is_mean_of_per_class_drops_from_the_best_earlier_round():
    hist = [[0.5, 0.9], [0.8, 0.2], [0.6, 0.4]]
    # class 0: max(0.5, 0.8) - 0.6 = 0.2; class 1: max(0.9, 0.2) - 0.4 = 0.5
    assert forgetting(hist) == pytest.approx(0.35)
    # a class the test split has no sample of (None) is out of the mean, not a 0 that dilutes it
    assert forgetting([[0.5, 0.9, None], [0.8, 0.2, None], [0.6, 0.4, None]]) == pytest.approx(0.35)


def test_a_class_without_test_samples_has_no_accuracy():
    from fedmosaic.engine.evaluate import global_metrics

    y = torch.tensor([0, 0, 2])
    g = global_metrics(torch.tensor([True, False, True]), torch.zeros(3), y, 3)
    assert g["class_acc"] == [0.5, None, 1.0] and g["acc"] == pytest.approx(2 / 3)


def test_algorithm_specs_become_config_entries():
    assert algorithm_spec("fedprox:mu=0.1") == {"name": "fedprox", "mu": 0.1}
    assert algorithm_spec("fedavg") == {"name": "fedavg"}
    assert algorithm_spec("fedntd:beta=1,tau=2.5e-1") == {"name": "fedntd", "beta": 1, "tau": 0.25}
    # not YAML: 1:2 (base 60 = 62), 0x10 and 1_0 stay text for the schema to refuse; no injected entries
    assert algorithm_spec("fedprox:mu=1:2") == {"name": "fedprox", "mu": "1:2"}
    assert algorithm_spec("fedprox:mu=0x10,x=1_0") == {"name": "fedprox", "mu": "0x10", "x": "1_0"}
    with pytest.raises(FedMosaicError, match="expected NAME"):  # no YAML to inject a third variant into
        algorithm_spec("fedprox:mu=0.1}, {name: fedavg")
    with pytest.raises(FedMosaicError, match="'mu' is given twice"):
        algorithm_spec("fedprox:mu=0.1,mu=0.2")
    with pytest.raises(FedMosaicError, match="expected NAME"):
        algorithm_spec("fedprox:mu")


def test_in_local_and_out_local_accuracy_weights_class_accuracy_by_the_label_distribution():
    from fedmosaic.engine.evaluate import in_out_local

    acc = torch.tensor([[1.0, 0.0, 0.5]])  # per-class accuracy of one local model
    counts = np.array([[3, 1, 0]])  # its client holds classes 0 and 1 (p = 0.75, 0.25, 0)
    inside, outside = in_out_local(acc, counts)
    assert inside == pytest.approx(0.75)
    assert outside == pytest.approx((0.25 * 1 + 0.75 * 0 + 1 * 0.5) / 2)
