"""FedMD (Li & Wang 2019): on the public stream every client moves its logits toward the consensus — the mean of
the cohort's logits, which is all the server sends back — with an L1 loss (the reference "digest" step), then trains
on its private data with CE ("revisit")."""

from ..protocol.algorithm import register_algorithm
from .exchange import LogitExchange


@register_algorithm
class FedMD(LogitExchange):
    name = "fedmd"

    def exchange(self, server, logits, clients, round_idx):
        return {"consensus": logits.mean(0)}

    def collaborate(self, ctx):
        _, s = ctx.forward()
        return ctx.mean((s - ctx.payload["consensus"][ctx.y]).abs().mean(-1))
