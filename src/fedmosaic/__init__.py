"""fedmosaic: federated learning when clients differ."""

__version__ = "0.1.0"
