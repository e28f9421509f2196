"""The small CNNs (fedavg_cnn, apfl_cnn, cnn4): the published architectures by default, and a BatchNorm variant for
methods about normalisation layers (FedBN keeps them local)."""

from __future__ import annotations

import pytest
import torch

from fedmosaic.errors import ConfigError
from fedmosaic.models import build_model, head_keys, norm_keys

# CIFAR-10 (3x32x32) parameter counts of the published CNNs: McMahan et al.'s / FedNTD's 5x5 convs with padding
# (32, 64) and FC 512 over 64*8*8 inputs; PFLlib's FedAvgCNN (no padding: 64*5*5 inputs)
PUBLISHED = {"fedavg_cnn": 2_156_490, "cnn4": 878_538}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_default_is_the_published_cnn_and_norm_batch_adds_a_batchnorm_after_each_convolution(name):
    plain, bn = build_model(name, (3, 32, 32), 10), build_model(name, (3, 32, 32), 10, norm="batch")
    assert sum(p.numel() for p in plain.parameters()) == PUBLISHED[name]
    assert not any(True for _ in plain.buffers()) and norm_keys(plain) == ()
    extra = {k for k, _ in bn.named_parameters()} - {k for k, _ in plain.named_parameters()}
    assert extra == {"bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"} and set(norm_keys(bn)) >= extra
    assert head_keys(bn) == head_keys(plain) == ("fc2.weight", "fc2.bias")
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    bn.train()
    bn(x)
    assert not torch.equal(bn.bn1.running_mean, torch.zeros_like(bn.bn1.running_mean))  # statistics of its own


def test_a_bad_norm_is_a_one_line_error():
    with pytest.raises(ConfigError, match="norm: 'none' or 'batch'"):
        build_model("fedavg_cnn", (3, 32, 32), 10, norm="group")
