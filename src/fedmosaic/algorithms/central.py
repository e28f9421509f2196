"""The "IID centralized" reference of the APFL paper: every client's train samples pooled, reshuffled and dealt out
again (each client keeps its number of samples), then FedAvg with one local epoch — what FedAvg reaches when the
data are not heterogeneous. Test splits stay the clients' own."""

from ..protocol.algorithm import Algorithm, register_algorithm
from ..protocol.program import Phase


@register_algorithm
class Central(Algorithm):
    name = "central"
    pooled = True

    def program(self, round_idx):
        return [Phase(epochs=1)]
