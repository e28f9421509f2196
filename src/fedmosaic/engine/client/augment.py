"""Training-time augmentation as batched tensor ops: random crop with zero padding, horizontal flip, cutout.

The random parameters of every (client, step, sample) are drawn up front from a generator seeded by (run seed,
round, client) — like the batch order — so augmentation is identical on every backend and chunk size, and the ops
themselves are plain indexing on the gathered batch (they run on any stack of clients at once). They are applied
after normalisation: the crop pads with black — the normalised value of a 0 pixel, ``fill`` — as torchvision's
RandomCrop does before Normalize in FedNTD's pipeline, while cutout fills with 0 after normalisation (the data mean),
as FedNTD's Cutout does after Normalize.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from ...errors import ConfigError
from ...schema import Schema
from ..seeding import AUGMENT, rng


class AugmentConfig(Schema):
    crop_padding: int = Field(0, ge=0, description="random crop of the original size after zero padding (0: off)")
    flip: bool = Field(False, description="random horizontal flip with probability 1/2")
    cutout: int = Field(0, ge=0, description="side of the square zeroed at a random centre (0: off)")

    @property
    def active(self) -> bool:
        return bool(self.crop_padding or self.flip or self.cutout)

    def check(self, input_shape: tuple[int, ...]) -> None:
        """Augmentation needs images [C, H, W], and its sizes are bounded by the image."""
        if not self.active:
            return
        if len(input_shape) != 3:
            raise ConfigError(f"data.augment: needs images, but the inputs have shape {tuple(input_shape)}")
        h, w = input_shape[1:]
        if self.crop_padding > min(h, w):
            raise ConfigError(f"data.augment.crop_padding: must be <= the image side {min(h, w)} "
                              f"(got {self.crop_padding})")
        if self.cutout > max(h, w):
            raise ConfigError(f"data.augment.cutout: must be <= the image side {max(h, w)} (got {self.cutout})")


def black(normalize, input_shape, device) -> torch.Tensor:
    """Per channel [C, 1, 1], the normalised value of a black (0) pixel: the crop's padding. With per-pixel
    normalisation the padding lies outside the image, so it takes the channel's mean of those values."""
    return normalize(torch.zeros(1, *input_shape, device=device))[0].mean((-2, -1), keepdim=True)


def draw(cfg: AugmentConfig, clients: np.ndarray, steps: np.ndarray, batch: int, shape, seed: int, round_idx: int,
         keys: tuple[int, ...] = ()):
    """Per client, step and sample: (crop dy, crop dx, flip, cutout cy, cutout cx), as int64 [S, n, B, 5].

    Client i's draws cover its own ``steps[i]`` steps only, so they do not depend on who else is in the chunk.
    """
    _, h, w = shape
    high = np.array([2 * cfg.crop_padding + 1, 2 * cfg.crop_padding + 1, 2 if cfg.flip else 1, h, w])
    out = np.zeros((len(clients), int(steps.max()) if len(clients) else 0, batch, 5), dtype=np.int64)
    for i, k in enumerate(clients):
        out[i, : steps[i]] = rng(seed, AUGMENT, round_idx, k, *keys).integers(0, high, (steps[i], batch, 5))
    return torch.as_tensor(out.transpose(1, 0, 2, 3).copy())


def apply(cfg: AugmentConfig, x: torch.Tensor, params: torch.Tensor, fill: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Augment images ``x`` [..., C, H, W] with ``params`` [..., 5] from :func:`draw` (leading axes match).

    ``fill``: the value of the crop's padding, a scalar or per channel [C, 1, 1] (black after normalisation)."""
    lead = x.shape[:-3]
    c, h, w = x.shape[-3:]
    x = x.reshape(-1, c, h, w)
    p = params.reshape(-1, 5)
    n = x.shape[0]
    dev = x.device
    ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
    if cfg.crop_padding:
        pad = cfg.crop_padding
        xp = torch.nn.functional.pad(x - fill, (pad, pad, pad, pad)) + fill
        iy = (p[:, 0, None] + ys)[:, None, :, None]  # [n, 1, H, 1]
        ix = (p[:, 1, None] + xs)[:, None, None, :]  # [n, 1, 1, W]
        x = xp[torch.arange(n, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None], iy, ix]
    if cfg.flip:
        x = torch.where(p[:, 2, None, None, None] > 0, x.flip(-1), x)
    if cfg.cutout:
        # DeVries & Taylor: rows [cy - L/2, cy - L/2 + L), clipped at the border
        dy = ys[None, :] - (p[:, 3, None] - cfg.cutout // 2)
        dx = xs[None, :] - (p[:, 4, None] - cfg.cutout // 2)
        hole = ((dy >= 0) & (dy < cfg.cutout))[:, :, None] & ((dx >= 0) & (dx < cfg.cutout))[:, None, :]
        x = x.masked_fill(hole[:, None], 0.0)
    return x.reshape(*lead, c, h, w)
