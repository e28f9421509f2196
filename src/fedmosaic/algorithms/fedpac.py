"""FedPAC (Xu, Tong, Huang 2023): feature alignment to global class centroids, and classifier collaboration.

The model is split into its feature extractor (``body``) and classifier (``head``: the parameters ``head()`` uses).
Round t, client k:

1. starts from the global body and its own head — the combination the server made for it the last time it took
   part (the initial head before);
2. one pass over its data at this received model gives its statistics for the classifier collaboration: with
   n_k samples, n_c of class c, p_c = n_c / n_k, F_c the features of class c and mu_c their mean,
   h_k = [p_c mu_c]_c (C x d) and V_k = [sum_c p_c tr(F_c^T F_c) / n_c − sum_c p_c^2 ||mu_c||^2] / n_k;
3. trains the head alone for ``head_epochs`` epochs (body fixed, learning rate ``head_lr``), cross-entropy;
4. trains the body alone for ``train.local_epochs`` epochs (head fixed): cross-entropy + lam * MSE(f(x), c_y), with
   c_y the global centroid of class y (no term for a class without one: in the first round, or a class nobody in
   the last cohort had);
5. one pass over its data at its final model gives per class the feature sums; it uploads body, head, these sums
   and the statistics of step 2.

Server: body ← mean of the bodies (weighted by train size); centroid c ← mean of the clients' final class means
weighted by their counts, for the classes this round's cohort has (the others have none until a cohort has them
again); classifier collaboration: each cohort client i gets the weights over the cohort

    alpha_i = argmin over the simplex of  ||sum_j alpha_j h_j − h_i||_F^2 + sum_j alpha_j^2 V_j

(bias to its own statistics plus the variance of the combination; the paper's estimate of client i's test loss,
solved here by accelerated projected gradient instead of a QP package), weights below 1e-3 set to 0 and the rest
renormalised, and its new head sum_j alpha_ij head_j, kept on the server and sent to it alone the next time it
takes part. Personal model: the global body with its own head. The global model (for the global metrics) is the
body with the size-weighted mean of the cohort's heads.

Compared with the authors' code (github.com/JianXu95/FedPAC: ``methods/fedpac.py`` ``statistics_extraction`` and
``local_training``, ``tools.py`` ``get_head_agg_weight``, ``protos_aggregation``, ``running.py``
``train_round_fedpac``): V, h, the bias-variance QP, the 1e-3 cut, the count-weighted centroids from the final
model and the size-weighted body follow it. There the head's learning rate is 0.1 (the body's 0.01); here
``head_lr`` (default: the round's). Where a class of a client has no global centroid, their training loop targets
the client's own class mean at the received model (their centroid update would first fail on the missing class);
here such samples get no alignment term.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext, TaskLoss
from ..protocol.program import Phase, Probe, Step
from ..protocol.tree import cumsum, repeat, split_keys, tmap, weighted_mean
from .terms import PrototypeMSE, class_sums

BOTH = ("body", "head")

#: collaboration weights below this are set to 0 before renormalising (the authors' ``eps`` in get_head_agg_weight)
CUT = 1e-3


class FedPACConfig(AlgoConfig):
    lam: float = Field(1.0, ge=0, description="weight of the feature alignment (MSE to the global class centroid)")
    head_epochs: int = Field(1, ge=0, le=10_000, description="epochs of head-only training before the body's")
    head_lr: float | None = Field(None, gt=0, description="learning rate of the head phase (None: the round's; the "
                                  "authors' code uses 0.1 with a body learning rate of 0.01)")
    iters: int = Field(1000, ge=1, le=100_000, description="accelerated projected-gradient iterations of the head "
                       "weights")


def simplex_projection(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row of ``v`` onto the probability simplex (sort-based, exact)."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = cumsum(u, -1) - 1
    k = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    rho = ((u - css / k) > 0).to(torch.int64).cumsum(-1).argmax(-1, keepdim=True)  # last index where it holds
    theta = css.gather(-1, rho) / (rho + 1).to(v.dtype)
    return (v - theta).clamp(min=0)


def collaboration_weights(h: torch.Tensor, V: torch.Tensor, iters: int = 1000, cut: float = 0.0) -> torch.Tensor:
    """[n, n]: row i = argmin over the simplex of ||sum_j a_j h_j − h_i||^2 + sum_j a_j^2 V_j, for ``h`` [n, ...] and
    ``V`` [n]; then weights below ``cut`` set to 0 and the row renormalised. Projected gradient with Nesterov
    momentum (FISTA, restarted when the objective rises: the problem can be badly conditioned when V is small),
    step 1 / the largest curvature, from a_i = e_i."""
    n = len(h)
    flat = h.reshape(n, -1).double()
    diff = flat[None, :, :] - flat[:, None, :]  # [i, j, :] = h_j − h_i
    Q = diff @ diff.transpose(1, 2) + torch.diag_embed(V.double().clamp(min=0)).expand(n, n, n)
    step = 1 / (2 * torch.linalg.eigvalsh(Q)[:, -1:].clamp(min=1e-12))
    f = lambda a: (a[:, None, :] @ Q @ a[..., None])[:, 0, 0]
    a = y = torch.eye(n, dtype=torch.float64, device=h.device)
    t, fa = torch.ones(n, 1, dtype=torch.float64, device=h.device), f(a)
    for _ in range(iters):
        new = simplex_projection(y - step * 2 * (Q @ y[..., None])[..., 0])
        f_new = f(new)
        t_new = (1 + (1 + 4 * t * t).sqrt()) / 2
        up = (f_new > fa)[:, None]  # restart: the momentum overshot
        y = torch.where(up, a, new + (t - 1) / t_new * (new - a))
        t = torch.where(up, torch.ones_like(t), t_new)
        a, fa = torch.where(up, a, new), torch.where(up[:, 0], fa, f_new)
    a = a * (a >= cut)
    return (a / a.sum(-1, keepdim=True)).to(h.dtype)


@register_algorithm
class FedPAC(Algorithm):
    name = "fedpac"
    Config = FedPACConfig
    personalized = True

    def _split(self, tree: dict) -> tuple[dict, dict]:
        return split_keys(tree, self.setting.head_keys)

    def init_server(self, init_params):
        model = init_params[0]
        _, head = self._split(model)
        C, d = self.num_classes, self.feature_dim
        dev = next(iter(model.values())).device
        return {"model": model, "protos": torch.zeros(C, d, device=dev), "has": torch.zeros(C, device=dev),
                "heads": repeat(head, self.num_clients)}

    def broadcast(self, server, round_idx):
        return {"global": server["model"], "protos": server["protos"], "has": server["has"]}

    def client_payload(self, server, clients):
        return {"head": tmap(lambda t: t[clients], server["heads"])}

    def local_init(self, payload, state):
        body, _ = self._split(payload["global"])
        return {"body": body, "head": payload["own"]["head"]}

    def terms(self):
        return [TaskLoss(BOTH), PrototypeMSE(self.cfg.lam, BOTH)]

    def program(self, round_idx):
        head = Phase(epochs=self.cfg.head_epochs, updates=(Step(("head",), TaskLoss(BOTH), lr=self.cfg.head_lr),),
                     key=1)
        return [*([head] if self.cfg.head_epochs else []), Phase(updates=(Step(("body",)),), key=0)]

    def probes(self, round_idx, payload):
        return [Probe("received", at="received", kind="sums", objective=self.statistics),
                Probe("final", at="final", kind="sums", objective=self.centroid_sums)]

    def statistics(self, ctx: LocalContext) -> dict:
        """Per class feature sums and counts, and the sum of squared feature norms (at the received model)."""
        z, _ = ctx.forward(BOTH)
        return {**class_sums(ctx, self.num_classes, BOTH), "sq": ((z * z).sum(1) * ctx.mask).sum()}

    def centroid_sums(self, ctx: LocalContext) -> dict:
        return class_sums(ctx, self.num_classes, BOTH)

    def finish(self, params, state, payload, stats):
        got, final = stats["received"], stats["final"]
        return {"body": params["body"], "head": params["head"], "count": got["count"], "h_sum": got["sum"],
                "sq": got["sq"], "sum": final["sum"]}, state

    def aggregate(self, server, uploads, weights, round_idx, signals):
        count = uploads["count"]  # [n, C]
        total = count.sum(0)
        protos = uploads["sum"].sum(0) / total.clamp(min=1)[:, None]  # = the count-weighted mean of the class means
        n_k = count.sum(1).clamp(min=1)
        mu = uploads["h_sum"] / count.clamp(min=1)[..., None]  # class means at the received models
        prior = count / n_k[:, None]
        # sum_c p_c tr(F_c^T F_c) / n_c = sq / n_k; the authors' code then divides the whole by n_k once more
        V = (uploads["sq"] / n_k - (prior * prior * (mu * mu).sum(-1)).sum(1)) / n_k
        alpha = collaboration_weights(prior[..., None] * mu, V, self.cfg.iters, CUT)
        heads = tmap(lambda t: torch.einsum("ij,j...->i...", alpha, t), uploads["head"])
        new = tmap(lambda all_, mine: all_.index_put((signals.clients,), mine), server["heads"], heads)
        model = {**weighted_mean(uploads["body"], weights), **weighted_mean(uploads["head"], weights)}
        has = (total > 0).to(protos.dtype)  # this round's cohort only: no stale centroid
        return {"model": model, "protos": protos * has[:, None], "has": has, "heads": new}

    def personal_params(self, state, payload):
        body, _ = self._split(payload["global"])
        return {**body, **payload["own"]["head"]}
