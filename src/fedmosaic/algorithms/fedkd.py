"""FedKD (Wu et al. 2022): a private mentor and a shared mentee per client, adaptive mutual distillation, and the
mentee's updates sent as truncated SVD factors.

Each client keeps a mentor (``mentor``: any registered model, by default the run's architecture; persistent,
never sent) and trains it together with the mentee it receives (the run's model, the one that is aggregated). On
every batch, with task losses L_s (mentee) and L_t (mentor) and softened outputs p_s, p_t (temperature ``tau``):

    mentee:  L_s + KL(p_t || p_s) / (L_s + L_t)        mentor:  L_t + KL(p_s || p_t) / (L_s + L_t)

(the other model's output is the target, detached; the adaptive weight 1 / (L_s + L_t) is a weight, detached:
distillation counts more when both models are already right). ``kd_reduction`` sets the KL's scale: ``element``
(default) its sum over the batch's B x C entries divided by B·C — what the authors' code computes (``nn.KLDivLoss()``,
whose default reduction is the element mean; github.com/wuch15/FedKD ``model_bert.py``) —, ``sample`` the KL of each
sample (summed over the C classes) averaged over the batch, the paper's formula read as a true KL: C times stronger.
The client uploads the mentee's update Δ = w − w_global with every matrix replaced by its truncated SVD: the fewest
singular components whose energy (sum of squared singular values) reaches T, with T = t_start + (r + 1) / R ·
(t_end − t_start) in round r of R (as the authors' ``run.py``: t_end in the last round). So that this vmaps, the
factors keep their full shape with the dropped components zeroed; the bytes counted are those of the kept
components, k (m + n) floats per matrix (``pack_upload``). The server adds the weighted mean of the reconstructed
updates to the global mentee. Personal model: the client's mentor (evaluated with its architecture).

Departures from the authors' code: it detaches neither the targets of the two KL terms nor the adaptive weight
(one summed loss, backpropagated through everything; here each model learns from the other's output as a fixed
target, as the paper's separate mentor and mentee losses read, and the weight is a constant, which the paper does
not specify); it adds the hidden-state and attention MSE between the two models'
transformer layers (weighted by the same 1 / (L_s + L_t)), which has no counterpart here; its server averages the
updates unweighted (its clients hold equal data) and compresses the download too (sent dense here).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from ..protocol.algorithm import AlgoConfig, Algorithm, register_algorithm
from ..protocol.context import LocalContext, per_sample_task_loss
from ..protocol.tree import clone, cumsum, leaves, weighted_mean


class FedKDConfig(AlgoConfig):
    mentor: str | None = Field(None, description="the mentor's model name (default: the run's model)")
    mentor_options: dict = Field(default_factory=dict, description="the mentor's model options (with mentor set)")
    tau: float = Field(1.0, gt=0, description="softmax temperature of the mutual distillation")
    kd_reduction: Literal["element", "sample"] = Field(
        "element", description="scale of the KL terms: element = mean over the batch x classes entries (the "
        "authors' code), sample = per-sample KL averaged over the batch (C times stronger)")
    distill: bool = Field(True, description="mutual distillation (false: the two models train side by side)")
    svd: bool = Field(True, description="send the mentee's update as truncated SVD factors (false: dense)")
    t_start: float = Field(0.95, gt=0, le=1, description="SVD energy threshold the schedule starts from (round r of "
                           "R keeps t_start + (r + 1) / R (t_end - t_start))")
    t_end: float = Field(0.98, gt=0, le=1, description="SVD energy kept in the last round")

    @model_validator(mode="after")
    def _no_ignored_option(self):
        """Refuse options the run would ignore: the user asked for something it would not do."""
        if self.mentor_options and self.mentor is None:
            raise ValueError("mentor_options: needs mentor, the mentor's model name (without it the mentor is the "
                             "run's model with model.options); set mentor or drop mentor_options")
        unused = {"distill": ("tau", "kd_reduction"), "svd": ("t_start", "t_end")}
        for switch, names in unused.items():
            given = [n for n in names if n in self.model_fields_set]
            if given and not getattr(self, switch):
                raise ValueError(f"{given[0]}: has no effect with {switch}: false; drop {' and '.join(given)} or "
                                 f"set {switch}: true")
        return self


def truncated_svd(d: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U·diag(s), Vᵀ) of matrix ``d`` keeping the fewest leading components whose energy reaches ``energy`` of the
    total; the others zeroed (fixed shapes)."""
    U, s, Vh = torch.linalg.svd(d, full_matrices=False)
    e = s * s
    keep = ((cumsum(e, 0) - e) < energy * e.sum()).to(d.dtype)  # the energy before component j is still short
    return U * (s * keep), Vh * keep[:, None]


@register_algorithm
class FedKD(Algorithm):
    name = "fedkd"
    Config = FedKDConfig
    personalized = True
    personal_slot = "mentor"

    @classmethod
    def extra_models(cls, cfg, model):
        return {"mentor": (cfg.mentor, cfg.mentor_options) if cfg.mentor else (model.name, model.options)}

    def broadcast(self, server, round_idx):
        frac = min(1.0, (round_idx + 1) / self.setting.rounds)
        energy = self.cfg.t_start + (self.cfg.t_end - self.cfg.t_start) * frac
        return {"global": server["model"], "energy": torch.tensor(energy, device=leaves(server["model"])[0].device)}

    def init_client(self, init_params):
        return {"mentor": clone(self.setting.models["mentor"])}

    def local_init(self, payload, state):
        return {"model": payload["global"], "mentor": state["mentor"]}

    def loss(self, ctx: LocalContext) -> torch.Tensor:
        _, ls = ctx.forward("model")
        _, lt = ctx.forward("mentor")
        ce_s = ctx.term("ce_mentee", ctx.mean(per_sample_task_loss(ctx.task_loss, ls, ctx.y)))
        ce_t = ctx.term("ce_mentor", ctx.mean(per_sample_task_loss(ctx.task_loss, lt, ctx.y)))
        if not self.cfg.distill:
            return ce_s + ce_t
        w = 1 / (ce_s + ce_t).detach().clamp(min=1e-12)
        return (ce_s + ce_t + ctx.term("kd_mentee", w * self._kl(ctx, lt.detach(), ls))
                + ctx.term("kd_mentor", w * self._kl(ctx, ls.detach(), lt)))

    def _kl(self, ctx: LocalContext, target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """KL(softmax(target / tau) || softmax(logits / tau)) per sample, averaged over the batch's samples (and
        divided by the number of classes with ``kd_reduction: element``: the mean over its B x C entries)."""
        log_p = (target / self.cfg.tau).log_softmax(-1)
        kl = ctx.mean((log_p.exp() * (log_p - (logits / self.cfg.tau).log_softmax(-1))).sum(-1))
        return kl / logits.shape[-1] if self.cfg.kd_reduction == "element" else kl

    def finish(self, params, state, payload, stats):
        delta = {k: params["model"][k] - g for k, g in payload["global"].items()}
        if not self.cfg.svd:
            return {"dense": delta}, {"mentor": params["mentor"]}
        factors = {k: truncated_svd(d, payload["energy"]) for k, d in delta.items() if d.dim() == 2}
        return ({"dense": {k: d for k, d in delta.items() if k not in factors},
                 "u": {k: f[0] for k, f in factors.items()}, "v": {k: f[1] for k, f in factors.items()}},
                {"mentor": params["mentor"]})

    def pack_upload(self, upload):
        """The kept components only: per matrix the leading k columns of U·diag(s) and rows of Vᵀ, k (m + n)
        numbers (the zeroed ones travel as the full width ``r``)."""
        u, v = upload.get("u", {}), upload.get("v", {})
        kept = {k: int(((u[k].abs().sum(-2) > 0) | (v[k].abs().sum(-1) > 0)).sum()) for k in u}
        return {**upload, "u": {k: u[k][..., : kept[k]] for k in u}, "v": {k: v[k][..., : kept[k], :] for k in v},
                "r": {k: u[k].shape[-1] for k in u}}

    def unpack_upload(self, body):
        if "u" not in body:
            return body
        u, v = body["u"], body["v"]
        for k in u:  # the full width of an SVD of an m x n matrix is at most min(m, n): never pad beyond it
            r = body["r"][k]
            if not (isinstance(r, int) and u[k].shape[-1] <= r <= min(u[k].shape[-2], v[k].shape[-1])):
                raise ValueError(f"fedkd: width r of {k!r} is {r!r}, outside [{u[k].shape[-1]}, "
                                 f"{min(u[k].shape[-2], v[k].shape[-1])}]")
        pad = {k: body["r"][k] - u[k].shape[-1] for k in u}
        return {"dense": body["dense"],
                "u": {k: torch.nn.functional.pad(t, (0, pad[k])) for k, t in u.items()},
                "v": {k: torch.nn.functional.pad(t, (0, 0, 0, pad[k])) for k, t in v.items()}}

    def aggregate(self, server, uploads, weights, round_idx, signals):
        delta = {**uploads["dense"], **{k: uploads["u"][k] @ uploads["v"][k] for k in uploads.get("u", {})}}
        mean = weighted_mean(delta, weights)
        return {**server, "model": {k: g + mean[k] for k, g in server["model"].items()}}

    def personal_params(self, state, payload):
        return state["mentor"]
