"""FedAvg (McMahan et al.): local SGD on the task loss, weighted average of the client models."""

from ..protocol.algorithm import Algorithm, register_algorithm


@register_algorithm
class FedAvg(Algorithm):
    name = "fedavg"
