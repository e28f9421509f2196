"""Client pools (this package): where the server's messages go and where the clients' answers come from.

A pool offers the client actions of a round — ``warm_up``, ``public_logits``, ``train``, ``end_task``,
``evaluate`` — over the clients it hosts, and the clients' part of a checkpoint. The driver
(``engine.federation.Federation``) hands it the server runtime's messages (``server.runtime.ServerRuntime``) and
the server its answers; neither side touches the other's state.

``local.InProcessPool`` hosts every client in one ``client.runtime.ClientRuntime`` and hands the messages over as
they are: the stacked, vmapped, chunked fast path of the simulator. ``wire.WirePool`` hosts each client (or each
shard of clients) in a runtime of its own and passes every message through the codec as bytes — the proof that
nothing crosses between the server and its clients except messages. Both answer in the same order, (architecture,
client id), so the server's arithmetic is the same whichever pool served it.
"""
