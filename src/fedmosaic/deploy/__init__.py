"""Deployment with Flower: the same config and algorithm, the server runtime in a Flower ServerApp and each client's
runtime in a ClientApp on its own SuperNode (``fedmosaic deploy``).

- ``common``: what both sides agree on — the record a message travels in, a client's data fingerprint, what can be
  deployed.
- ``node``: the ClientApp — one client per SuperNode, its state in ``Context.state`` and in a node-local file.
- ``server``: the ServerApp and its client pool (``FlowerPool``): first contact, requests with timeouts, the checks
  every reply passes before anything of it is used.
- ``prepare``: the app, TLS certificates, node keys and the commands for a federation (``fedmosaic deploy``).

Flower (``pip install 'fedmosaic[flower]'``) is imported only here.
"""
