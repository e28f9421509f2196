"""FedPAC (Xu, Tong, Huang 2023): feature alignment to global class centroids, and classifier collaboration.

The model is split into its feature extractor (``body``) and classifier (``head``: the parameters ``head()`` uses).
Round t, client k:

1. starts from the global body and its own head — the combination the server made for it the last time it took
   part (the initial head before);
2. trains the head alone for ``head_epochs`` epochs (body fixed), cross-entropy;
3. trains the body alone for ``train.local_epochs`` epochs (head fixed): cross-entropy + lam * MSE(f(x), c_y), with
   c_y the global centroid of class y (no term for a class without one, e.g. in the first round);
4. one pass over its data at its final model gives per class the feature sums and counts, and the sum of squared
   feature norms; it uploads body, head and these sums.

Server: body ← mean of the bodies (weighted by train size); centroid c ← mean of the clients' class means weighted
by their counts; classifier collaboration: with p_{k,c} client k's class priors and mu_{k,c} its class means,
h_k = [p_{k,c} mu_{k,c}]_c (C x d) and V_k = (1/n_k) sum ||z||^2 − sum_c p_{k,c} ||mu_{k,c}||^2 (its mean feature
variance), each cohort client i gets the weights over the cohort

    alpha_i = argmin over the simplex of  ||sum_j alpha_j h_j − h_i||_F^2 + sum_j alpha_j^2 V_j

(bias to its own statistics plus the variance of the combination; the paper's estimate of client i's test loss,
solved here by projected gradient instead of a QP package), and its new head sum_j alpha_ij head_j, kept on the
server and sent to it alone the next time it takes part. Personal model: the global body with its own head.
The global model (for the global metrics) is the body with the size-weighted mean of the cohort's heads.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..engine.program import Phase, Probe, Step
from ..engine.tree import tmap, weighted_mean
from .base import AlgoConfig, Algorithm, register_algorithm
from .terms import LocalContext, PrototypeMSE, TaskLoss, class_sums

BOTH = ("body", "head")


class FedPACConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the feature alignment (MSE to the global class centroid)")
    head_epochs: int = Field(1, ge=0, le=10_000, description="epochs of head-only training before the body's")
    iters: int = Field(500, ge=1, le=100_000, description="projected-gradient iterations of the head weights")


def simplex_projection(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row of ``v`` onto the probability simplex (sort-based, exact)."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = u.cumsum(-1) - 1
    k = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    rho = ((u - css / k) > 0).to(v.dtype).cumsum(-1).argmax(-1, keepdim=True)  # last index where it holds
    theta = css.gather(-1, rho) / (rho + 1).to(v.dtype)
    return (v - theta).clamp(min=0)


def collaboration_weights(h: torch.Tensor, V: torch.Tensor, iters: int = 500) -> torch.Tensor:
    """[n, n]: row i = argmin over the simplex of ||sum_j a_j h_j − h_i||^2 + sum_j a_j^2 V_j, for ``h`` [n, ...] and
    ``V`` [n] (projected gradient with step 1 / the largest curvature; starts from a_i = e_i)."""
    n = len(h)
    flat = h.reshape(n, -1).double()
    diff = flat[None, :, :] - flat[:, None, :]  # [i, j, :] = h_j − h_i
    Q = diff @ diff.transpose(1, 2) + torch.diag_embed(V.double().clamp(min=0)).expand(n, n, n)
    step = 1 / (2 * torch.linalg.eigvalsh(Q)[:, -1:].clamp(min=1e-12))
    a = torch.eye(n, dtype=torch.float64, device=h.device)
    for _ in range(iters):
        a = simplex_projection(a - step * 2 * (Q @ a[..., None])[..., 0])
    return a.to(h.dtype)


@register_algorithm
class FedPAC(Algorithm):
    name = "fedpac"
    Config = FedPACConfig
    personalized = True

    def _split(self, tree: dict) -> tuple[dict, dict]:
        head = set(self.setting.head_keys)
        return {k: v for k, v in tree.items() if k not in head}, {k: v for k, v in tree.items() if k in head}

    def init_server(self, init_params):
        model = init_params[0]
        _, head = self._split(model)
        C, d = self.num_classes, self.feature_dim
        dev = next(iter(model.values())).device
        return {"model": model, "protos": torch.zeros(C, d, device=dev), "has": torch.zeros(C, device=dev),
                "heads": tmap(lambda t: t.unsqueeze(0).repeat(self.num_clients, *([1] * t.dim())), head)}

    def broadcast(self, server, round_idx):
        return {"global": server["model"], "protos": server["protos"], "has": server["has"]}

    def client_payload(self, server, clients):
        return {"head": tmap(lambda t: t[clients], server["heads"])}

    def local_init(self, payload, state):
        body, _ = self._split(payload["global"])
        return {"body": body, "head": payload["own"]["head"]}

    def terms(self):
        return [TaskLoss(BOTH), PrototypeMSE(self.cfg.lam, BOTH)]

    def program(self, server, round_idx):
        head = [Phase(epochs=self.cfg.head_epochs, updates=(Step(("head",), TaskLoss(BOTH)),), key=1)]
        return [*(head if self.cfg.head_epochs else []), Phase(updates=(Step(("body",)),), key=0)]

    def probes(self, server, round_idx):
        return [Probe("stats", at="final", kind="sums", objective=self.statistics)]

    def statistics(self, ctx: LocalContext) -> dict:
        z, _ = ctx.forward(BOTH)
        return {**class_sums(ctx, self.num_classes, BOTH), "sq": ((z * z).sum(1) * ctx.mask).sum()}

    def finish(self, params, state, payload, stats):
        return {"body": params["body"], "head": params["head"], **stats["stats"]}, state

    def aggregate(self, server, uploads, weights, round_idx, signals):
        count, sums = uploads["count"], uploads["sum"]  # [n, C], [n, C, d]
        total = count.sum(0)
        protos = sums.sum(0) / total.clamp(min=1)[:, None]  # = the count-weighted mean of the class means
        n_k = count.sum(1).clamp(min=1)
        mu = sums / count.clamp(min=1)[..., None]
        prior = count / n_k[:, None]
        h = prior[..., None] * mu
        V = uploads["sq"] / n_k - (prior * (mu * mu).sum(-1)).sum(1)
        alpha = collaboration_weights(h, V, self.cfg.iters)
        heads = tmap(lambda t: torch.einsum("ij,j...->i...", alpha, t), uploads["head"])
        cids = signals.clients
        new = tmap(lambda all_, mine: all_.index_put((cids,), mine), server["heads"], heads)
        model = {**weighted_mean(uploads["body"], weights), **weighted_mean(uploads["head"], weights)}
        return {"model": model, "protos": torch.where(total[:, None] > 0, protos, server["protos"]),
                "has": torch.maximum(server["has"], (total > 0).to(protos.dtype)), "heads": new}

    def personal_params(self, state, server, own):
        body, _ = self._split(server["model"])
        return {**body, **own["head"]}
