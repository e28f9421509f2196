"""The in-process pool: every client in one runtime, messages handed over as they are — the stacked, vmapped,
chunked fast path of the simulator."""

from __future__ import annotations

from ..client.runtime import ClientRuntime


class InProcessPool:
    """Every client in one runtime: the messages go in and out as they are — no copies, no codec."""

    def __init__(self, runtime: ClientRuntime):
        self.runtime = runtime
        self.runtimes = [runtime]

    def notes(self) -> dict:
        """What a round's record says of the pool itself (a deployment: who answered): nothing here."""
        return {}

    def meta(self) -> dict:
        """What ``meta.json`` records of the pool (a deployment's driver and nodes): nothing here."""
        return {}

    def warm_up(self, lr: float, assignment: dict) -> None:
        self.runtime.warm_up(lr, assignment)

    def public_logits(self, broadcast: dict, assignment: dict, round_idx: int) -> dict:
        return self.runtime.public_logits(broadcast, assignment)

    def train(self, header: dict, broadcast: dict, assignment: dict) -> list[dict]:
        return self.runtime.train(header, broadcast, assignment)

    def end_task(self, header: dict, payload: dict, assignment: dict, model) -> None:
        self.runtime.end_task(header, payload, assignment, model)

    def evaluate(self, request: dict) -> dict:
        return self.runtime.evaluate(request)

    def state(self) -> list[dict]:
        return [self.runtime.state()]

    def load(self, parts: list[dict]) -> None:
        self.runtime.load(parts[0])

    def close(self) -> None:
        """The run is over (or starts again on a new pool): free what the pool holds outside this process."""

    def hosted(self) -> list:
        """Per runtime the clients it hosts (``client.runtime.Hosted``): the rows of a checkpoint each one loads."""
        return [rt.hosted() for rt in self.runtimes]


