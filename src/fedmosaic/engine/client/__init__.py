"""The client side: a runtime hosting some clients' state (``runtime.py``) and their local training — the objective,
batch plans, vectorized and looped steps, probes, optimisers, augmentation, exemplar memory, execution choice."""
