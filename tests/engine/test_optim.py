"""The in-place stacked optimisers follow torch.optim exactly, client by client."""

import pytest
import torch

from fedmosaic.engine.client import optim


@pytest.mark.parametrize("cfg, make", [
    (dict(name="sgd", lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (dict(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-2),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2)),
    (dict(name="sgd", lr=0.1, momentum=0.5, nesterov=True), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, nesterov=True)),
    (dict(name="adam", lr=0.01, weight_decay=1e-3), lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3)),
])
def test_matches_torch_optim_per_client(cfg, make):
    cfg = optim.OptimizerConfig(**cfg)
    g = torch.Generator().manual_seed(0)
    n, shape = 3, (4, 5)
    init = torch.randn(n, *shape, generator=g)
    grads = [torch.randn(n, *shape, generator=g) for _ in range(6)]
    stacked = {"w": init.clone()}
    state = optim.init_state(cfg, [stacked["w"]])
    for s, gr in enumerate(grads):
        optim.update_(cfg, [stacked["w"]], [gr], state, cfg.lr, s)
    for i in range(n):
        w = torch.nn.Parameter(init[i].clone())
        opt = make([w])
        for gr in grads:
            w.grad = gr[i].clone()
            opt.step()
        torch.testing.assert_close(stacked["w"][i], w.detach(), rtol=1e-5, atol=1e-6)


def test_lr_decay_per_round():
    cfg = optim.OptimizerConfig(lr=0.01, lr_decay=0.99)
    assert cfg.lr_at(0) == 0.01 and cfg.lr_at(2) == pytest.approx(0.01 * 0.99**2)
