"""The layer both sides of a round share, below the algorithms and the engine (both import it; it imports
neither): the tree helpers (``tree``) and the round-program vocabulary an algorithm declares its local training
in (``program``: View, Step, Phase, Probe, Setting, Signals)."""
