"""The CIFAR-style ResNets: parameter counts against the published CIFAR architectures, GroupNorm and BatchNorm
variants, and that a GroupNorm ResNet trains vectorized exactly as sequentially."""

from __future__ import annotations

import pytest
import torch

from fedmosaic.errors import ConfigError
from fedmosaic.models import build_model, head_keys

# CIFAR-10 heads. ResNet-18 and ResNet-34: the counts of the widely used CIFAR implementations (3x3 stem, no
# max-pool; e.g. kuangliu/pytorch-cifar: 11,173,962 and 21,282,122); ResNet-10/12 follow from the same blocks.
PUBLISHED = {"resnet10": 4_903_242, "resnet12": 4_977_226, "resnet18": 11_173_962, "resnet34": 21_282_122}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_parameter_counts_match_the_published_cifar_resnets(name, norm):
    with torch.device("meta"):
        m = build_model(name, (3, 32, 32), 10, norm=norm)
    assert sum(p.numel() for p in m.parameters()) == PUBLISHED[name]
    assert m.feature_dim == 512
    assert any(True for _ in m.buffers()) == (norm == "batch")  # BatchNorm keeps running statistics, GroupNorm none


def test_a_resnet_takes_grayscale_and_small_images_and_names_its_head():
    m = build_model("resnet10", (1, 28, 28), 7)
    z, logits = m(torch.zeros(3, 1, 28, 28), with_features=True)
    assert z.shape == (3, 512) and logits.shape == (3, 7)
    assert head_keys(m) == ("linear.weight", "linear.bias")


def test_bad_resnet_options_are_one_line_errors():
    with pytest.raises(ConfigError, match="norm: must be 'group' or 'batch'"):
        build_model("resnet10", (3, 32, 32), 10, norm="layer")
    with pytest.raises(ConfigError, match="groups: must divide 64"):
        build_model("resnet10", (3, 32, 32), 10, groups=3)


@pytest.mark.slow
def test_groupnorm_resnet_trains_vectorized_exactly_as_sequentially():
    from fedtest import assert_trees_close, train

    from fedmosaic.config import validate

    def cfg(backend):
        return validate({
            "seed": 1, "data": {"dataset": "digits", "clients": 12, "partition": {"scheme": "iid"}},
            "model": {"name": "resnet10", "options": {"norm": "group"}},
            "train": {"rounds": 1, "clients_per_round": 2, "local_epochs": 1, "batch_size": 32,
                      "optimizer": {"lr": 0.05}},
            "engine": {"backend": backend}})

    a, b = train(cfg("vectorized"), None), train(cfg("sequential"), None)
    assert_trees_close(a.server["model"], b.server["model"], atol=1e-5, rtol=1e-4)


# The CIFAR MobileNetV2 and EfficientNet-B0 of kuangliu/pytorch-cifar (the code the FCCL/RHFL/AHF experiments build
# on): 2,296,922 and 3,599,686 parameters for 10 classes. That EfficientNet builds an expansion conv for the
# expansion-1 block it never calls (32x32 weights + 2x32 BatchNorm = 1,088 parameters); ours does not build it.
MOBILE = {"mobilenetv2": (2_296_922, 1280), "efficientnet_b0": (3_599_686 - 1_088, 320)}


@pytest.mark.parametrize("name", sorted(MOBILE))
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_parameter_counts_match_the_published_cifar_mobile_networks(name, norm):
    with torch.device("meta"):
        m = build_model(name, (3, 32, 32), 10, norm=norm)
    assert sum(p.numel() for p in m.parameters()) == MOBILE[name][0]
    assert m.feature_dim == MOBILE[name][1]
    assert any(True for _ in m.buffers()) == (norm == "batch")


@pytest.mark.parametrize("name", ["resnet10", "mobilenetv2", "efficientnet_b0"])
def test_width_scales_channels_and_feature(name):
    full, quarter = build_model(name, (3, 16, 16), 10), build_model(name, (3, 16, 16), 10, width=0.25)
    assert quarter.feature_dim == full.feature_dim // 4
    assert sum(p.numel() for p in quarter.parameters()) < sum(p.numel() for p in full.parameters()) / 8
    with pytest.raises(ConfigError, match="width: must be a number in"):
        build_model(name, (3, 16, 16), 10, width=0)
    with pytest.raises(ConfigError, match="needs images"):
        build_model(name, (800,), 10)


def test_project_gives_any_model_a_common_feature_size():
    m = build_model("mobilenetv2", (3, 16, 16), 10, width=0.25, project=64)
    z, logits = m(torch.zeros(2, 3, 16, 16), with_features=True)
    assert z.shape == (2, 64) and logits.shape == (2, 10) and m.feature_dim == 64
    assert head_keys(m) == ("fc.weight", "fc.bias")
    with pytest.raises(ConfigError, match="project: must be a feature size"):
        build_model("mlp", (4,), 3, project=0)
