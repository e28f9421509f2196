"""Evaluation of a round: the global model on the global test set (the server's side), the clients' own splits
through the pool (``ClientRuntime.evaluate``), and class-incremental accuracy over the classes met so far."""

from __future__ import annotations

import numpy as np
import torch

from ..protocol.algorithm import Algorithm
from . import evaluate as ev


def metric_sides(fed) -> dict:
    """Where each metric of this run's evaluation is computed (kept in ``meta.json``): ``server`` — the global
    model on the global test set, and its continual accuracy; ``client`` — each client on its own splits, and
    its report; ``simulation`` — what needs data no deployment has in one place: the K x K cross matrix (every
    client's test split), the uploaded models' in/out-local accuracy (the clients' label histograms), personal
    models' continual accuracy (the global test set on every client)."""
    sides = {"global": "server", "global_clients": "client", "global_val": "client", "personal": "client",
             "personal_val": "client", "report": "client", "cross": "simulation", "local_in_acc": "simulation",
             "local_out_acc": "simulation"}
    if fed.tasks is not None:
        sides["continual"] = "server" if fed.algo.global_model else "simulation"
    return sides


def evaluate(fed, round_idx: int = 0) -> dict:
    """Metrics after round ``round_idx`` (which also seeds any fine-tuning before evaluation): the global model
    on the global test set here (server side); on the clients' splits, the personal models, the cross matrix
    and the clients' reports through the pool (``ClientRuntime.evaluate``)."""
    out: dict = {}
    ev_cfg, t = fed.settings.eval, round_idx
    gp = fed.algo.global_params(fed.server)
    sent = fed.algo.broadcast(fed.server, t)  # what the clients predict with, beside their own state
    for g in fed.groups:
        g.module.eval()  # BatchNorm: use the running statistics, do not update them
    model = None if gp is None else (gp, fed.groups[0].global_buffers)
    if model is not None and ev_cfg.global_test and fed.global_test is not None:
        x, y = fed.global_test
        g0 = fed.groups[0]
        transform, batch = g0.trainer.judging
        ok, ls = ev.score_samples(g0.apply, {**gp, **model[1]}, x, y, transform,
                                  lambda z, logits: fed.algo.eval_logits(z, logits, sent), batch=batch)
        out["global"] = ev.global_metrics(ok, ls, y, fed.fd.num_classes)
    personal = ev_cfg.client_test and fed.algo.personalized
    plan = None if fed.tasks is None else continual_plan(fed, t)
    reply = fed.pool.evaluate({
        "round": t, "payload": sent, "assignment": fed.assign(fed.everyone), "global": model,
        "global_clients": model is not None and ev_cfg.client_test, "global_val": model is not None,
        "personal": personal, "personal_val": personal, "cross": personal and ev_cfg.cross_clients,
        "report": asks_clients(type(fed.algo)),
        # personal models judge their continual rows in the same message (one message round, not two)
        **({} if plan is None or fed.algo.global_model else {"continual": plan["request"]})})
    apart = np.isin(np.arange(fed.num_clients), fed.srv.held_out)  # (participation.held_out: never trained)
    for key, split in (("global_clients", "test"), ("global_val", "val"), ("personal", "test"),
                       ("personal_val", "val")):
        if key in reply:
            correct, sizes = reply[key].cpu().numpy(), reply["sizes"][split].cpu().numpy()
            out[key] = ev.client_summary(correct * ~apart, sizes * ~apart)
            if apart.any():
                out.setdefault("held_out", {})[key] = ev.client_summary(correct * apart, sizes * apart)
    if "cross" in reply and int(reply["sizes"]["test"].sum()):
        cross, sizes = reply["cross"].cpu().numpy(), reply["sizes"]["test"].cpu().numpy()
        out["cross"] = ev.cross_summary(cross, sizes, ~apart)
        if apart.any():  # the held-out clients' models on their own and each other's splits, apart
            held = ev.cross_summary(cross, sizes, apart)
            out.setdefault("held_out", {})["cross"] = {k: held[k] for k in ("intra_avg", "inter_avg")}
        names = fed.fd.dataset.group_names
        if fed.settings.named_rows and names and len(names) == fed.num_clients:
            out["cross"]["names"] = list(names)  # one client per group: name the rows by the domain
    if plan is not None:
        out["continual"] = continual(fed, t, plan, reply.get("continual"))
    out.update(_report(fed, reply))
    return {**out, **_answered(fed)}


def report(fed, round_idx: int) -> dict:
    """The algorithm's report alone, between evaluations (``eval.report_every``): its measures of the server's
    and the clients' states, without reading any data."""
    if not reports(type(fed.algo)):
        return {}
    if not asks_clients(type(fed.algo)):  # measures of the server's state alone
        return _report(fed, {})
    reply = fed.pool.evaluate({"round": round_idx, "payload": fed.algo.broadcast(fed.server, round_idx),
                               "assignment": fed.assign(fed.everyone), "report": True})
    return {**_report(fed, reply), **_answered(fed)}


def reports(cls: type) -> bool:
    """Whether an algorithm (its class) reports measures of its own (``report``, ``client_report``)."""
    return cls.report is not Algorithm.report or asks_clients(cls)


def asks_clients(cls: type) -> bool:
    """Whether an algorithm's report needs its clients' states (``client_report``)."""
    return cls.client_report is not Algorithm.client_report


def _answered(fed) -> dict:
    """A deployment: who answered this round's evaluation request, and which of its metrics they reported."""
    notes = fed.pool.notes()
    return {"deploy_eval": notes["deploy"]} if notes else {}


def _report(fed, reply: dict) -> dict:
    got = fed.algo.report(fed.server, reply["report"]["reports"] if "report" in reply else {})
    return {"report": got} if got else {}


def continual_plan(fed, t: int) -> dict:
    """The samples each model judges in :meth:`_continual` after round ``t``, and the request of the personal
    models' part (``continual``: rows by client, in (architecture, id) order)."""
    stage = fed.stage(t)
    first = fed.first_met(stage)
    unseen = torch.as_tensor(first > stage, device=fed.device)
    order = np.concatenate([g.clients for g in fed.groups])  # the personal models, (architecture, id) order
    n = 1 if fed.algo.global_model else len(order)
    seen = np.flatnonzero(first[fed.global_labels] <= stage)
    rows = ev.deal(fed.global_labels, fed.test_ranks, seen, n, fed.settings.eval.continual_sample)
    return {"stage": stage, "first": first, "unseen": unseen, "seen": seen, "rows": rows, "n": n,
            "request": {"ids": torch.as_tensor(order), "rows": torch.as_tensor(rows), "unseen": unseen}}


def continual(fed, t: int, plan: dict | None = None, hits: torch.Tensor | None = None) -> dict:
    """Class-incremental accuracy after round ``t``: the model(s) clients predict with — the global one, or each
    client's own (then the mean over clients) — on the global test samples of every class met so far, choosing
    among those classes only (no task id). ``tasks[j]``: on the classes first met in stage j (the accuracy
    matrix's row; for a shared task order, task j's classes).

    An evaluation makes at most ``eval.continual_sample`` predictions, so its cost stays flat as classes
    accumulate: beyond it each model judges its share of a fixed class-stratified order of the seen samples
    (``evaluate.deal``; recorded as ``sample``). Each class's accuracy over its judged samples then counts by
    the class's test size, as in the full evaluation, which it equals when every model judges every sample.
    A global model is judged here; personal models by their clients (``ClientRuntime.evaluate``), each on the
    rows dealt to it (``hits``: their answers to ``plan["request"]``, asked here when not given)."""
    plan = plan or continual_plan(fed, t)
    stage, first, rows, seen, n = plan["stage"], plan["first"], plan["rows"], plan["seen"], plan["n"]
    labels, C = fed.global_labels, fed.fd.num_classes
    if fed.algo.global_model:
        x, y = fed.global_test
        sent, g = fed.algo.broadcast(fed.server, t), fed.groups[0]
        g.module.eval()
        params, bufs = fed.predictors(g, t, 1)
        masked = lambda z, logits: fed.algo.eval_logits(z, logits, sent).masked_fill(plan["unseen"],  # noqa
                                                                                      float("-inf"))
        transform, batch = g.trainer.judging
        hits = ev.judged_correct(g.apply, {**params, **bufs}, x, y, torch.as_tensor(rows, device=fed.device),
                                 transform, g.trainer.vectorize, masked, batch)
    elif hits is None:
        hits = fed.pool.evaluate({"round": t, "payload": fed.algo.broadcast(fed.server, t),
                                   "assignment": fed.assign(fed.everyone),
                                   "continual": plan["request"]})["continual"]
    hits = hits.cpu().numpy()
    acc = ev.judged_class_accuracy(rows, hits, labels, C)
    size = np.bincount(labels, minlength=C) * ~np.isnan(acc)  # classes by their test sizes (judged ones)
    acc = np.nan_to_num(acc)

    def mean(classes):
        return float(size[classes] @ acc[classes] / size[classes].sum()) if size[classes].any() else None

    out = {"stage": stage, "task_end": fed.task_ends(t), "seen_acc": mean(first <= stage),
           "tasks": [mean(first == j) for j in range(stage + 1)]}
    if rows.shape[1] < len(seen):
        out["sample"] = {"models": n, "per_model": rows.shape[1], "samples": len(np.unique(rows)),
                         "of": len(seen)}
    return out

