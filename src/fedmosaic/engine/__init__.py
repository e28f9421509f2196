"""The round engine: a built run's clients (``client/``), its server (``server/``), the pools that carry messages
between them (``pools/``) and the in-process driver of rounds (``federation.py``); below them the helpers both sides
share (seeding, tensors, mapping, evaluation, robustness, stopping)."""
