"""CIFAR-style MobileNetV2 (feature 1280) and EfficientNet-B0 (feature 320), the small networks of AHF's clients
(METHODS.md §2), as in the CIFAR implementations those papers' code builds on: a 3x3 stride-1 stem, no early
down-sampling beyond the listed strides, global average pooling, one linear classifier.

MobileNetV2: inverted residual blocks (1x1 expand, 3x3 depthwise, 1x1 project; ReLU), stages (expansion, channels,
blocks, stride) = (1,16,1,1) (6,24,2,1) (6,32,3,2) (6,64,4,2) (6,96,3,1) (6,160,3,2) (6,320,1,1), a 1x1 conv to 1280;
a stride-1 block whose channels change has a 1x1 projection shortcut. EfficientNet-B0: MBConv blocks with
squeeze-and-excitation (ratio 0.25 of the block's input channels) and swish, stages (expansion, channels, blocks,
kernel, stride) = (1,16,1,3,1) (6,24,2,3,2) (6,40,2,5,2) (6,80,3,3,2) (6,112,3,5,1) (6,192,4,5,2) (6,320,1,3,1); the
feature is the last stage's 320 channels (no 1280 head conv), without dropout or drop-connect (deterministic, so
vectorized and sequential training agree).

Options as for the ResNets: ``norm`` group (GroupNorm, vectorizes) | batch (BatchNorm), ``groups``, ``width``
(every channel count scaled, rounded to even numbers; the feature too).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import FedModel
from .resnet import check_images, check_width, norm_layer, scaled

MOBILENET_V2 = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1)]
EFFICIENTNET_B0 = [(1, 16, 1, 3, 1), (6, 24, 2, 3, 2), (6, 40, 2, 5, 2), (6, 80, 3, 3, 2), (6, 112, 3, 5, 1),
                   (6, 192, 4, 5, 2), (6, 320, 1, 3, 1)]


def _conv_norm(c_in, c_out, k, stride, norm, groups, depthwise=False):
    conv = nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=c_in if depthwise else 1, bias=False)
    return nn.Sequential(conv, norm_layer(norm, c_out, groups))


class InvertedResidual(nn.Module):
    def __init__(self, c_in, c_out, expansion, stride, norm, groups):
        super().__init__()
        mid = expansion * c_in
        self.expand = _conv_norm(c_in, mid, 1, 1, norm, groups)
        self.depthwise = _conv_norm(mid, mid, 3, stride, norm, groups, depthwise=True)
        self.project = _conv_norm(mid, c_out, 1, 1, norm, groups)
        # a residual connection only at stride 1, through a 1x1 projection where the channels change
        self.shortcut = None if stride != 1 else (nn.Sequential() if c_in == c_out
                                                  else _conv_norm(c_in, c_out, 1, 1, norm, groups))

    def forward(self, x):
        out = self.project(torch.relu(self.depthwise(torch.relu(self.expand(x)))))
        return out if self.shortcut is None else out + self.shortcut(x)


def _swish(x):
    return x * torch.sigmoid(x)


class MBConv(nn.Module):
    def __init__(self, c_in, c_out, expansion, kernel, stride, norm, groups, se_ratio=0.25):
        super().__init__()
        mid = expansion * c_in
        self.expand = _conv_norm(c_in, mid, 1, 1, norm, groups) if expansion != 1 else None
        self.depthwise = _conv_norm(mid, mid, kernel, stride, norm, groups, depthwise=True)
        se = max(1, int(c_in * se_ratio))
        self.se1, self.se2 = nn.Conv2d(mid, se, 1), nn.Conv2d(se, mid, 1)
        self.project = _conv_norm(mid, c_out, 1, 1, norm, groups)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        out = x if self.expand is None else _swish(self.expand(x))
        out = _swish(self.depthwise(out))
        w = torch.sigmoid(self.se2(_swish(self.se1(out.mean((2, 3), keepdim=True)))))
        out = self.project(out * w)
        return out + x if self.residual else out


class _Mobile(FedModel):
    def __init__(self, input_shape, num_classes, stem: int, blocks: nn.Sequential, tail: nn.Module | None,
                 feature_dim: int, norm, groups):
        super().__init__()
        self.stem = _conv_norm(input_shape[0], stem, 3, 1, norm, groups)
        self.blocks, self.tail = blocks, tail
        self.linear = nn.Linear(feature_dim, num_classes)
        self.feature_dim, self.num_classes = feature_dim, num_classes

    def head(self, z):
        return self.linear(z)


class MobileNetV2(_Mobile):
    def __init__(self, input_shape, num_classes, norm: str = "group", groups: int = 2, width: float = 1.0):
        check_images(input_shape)
        w = check_width(width)
        c, layers = scaled(32, w), []
        for expansion, out, n, stride in MOBILENET_V2:
            for j in range(n):
                layers.append(InvertedResidual(c, scaled(out, w), expansion, stride if j == 0 else 1, norm, groups))
                c = scaled(out, w)
        feat = scaled(1280, w)
        super().__init__(input_shape, num_classes, scaled(32, w), nn.Sequential(*layers),
                         _conv_norm(c, feat, 1, 1, norm, groups), feat, norm, groups)

    def features(self, x):
        return torch.relu(self.tail(self.blocks(torch.relu(self.stem(x))))).mean((2, 3))


class EfficientNetB0(_Mobile):
    def __init__(self, input_shape, num_classes, norm: str = "group", groups: int = 2, width: float = 1.0):
        check_images(input_shape)
        w = check_width(width)
        c, layers = scaled(32, w), []
        for expansion, out, n, kernel, stride in EFFICIENTNET_B0:
            for j in range(n):
                layers.append(MBConv(c, scaled(out, w), expansion, kernel, stride if j == 0 else 1, norm, groups))
                c = scaled(out, w)
        super().__init__(input_shape, num_classes, scaled(32, w), nn.Sequential(*layers), None, c, norm, groups)

    def features(self, x):
        return self.blocks(_swish(self.stem(x))).mean((2, 3))


def mobilenetv2(input_shape, num_classes, norm: str = "group", groups: int = 2, width: float = 1.0):
    """CIFAR-style MobileNetV2 (feature 1280); norm: group (GroupNorm, vectorizes) or batch (BatchNorm)."""
    return MobileNetV2(input_shape, num_classes, norm, groups, width)


def efficientnet_b0(input_shape, num_classes, norm: str = "group", groups: int = 2, width: float = 1.0):
    """CIFAR-style EfficientNet-B0 (feature 320, SE + swish); norm: group (GroupNorm, vectorizes) or batch."""
    return EfficientNetB0(input_shape, num_classes, norm, groups, width)


MOBILE = {"mobilenetv2": mobilenetv2, "efficientnet_b0": efficientnet_b0}
