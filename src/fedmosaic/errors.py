"""User-facing errors: the CLI prints these as one line, without a traceback."""


class FedMosaicError(Exception):
    """A mistake in user input or environment (bad config, missing files) — not a bug."""


class ConfigError(FedMosaicError, ValueError):
    """An invalid parameter; the message names the parameter and what is allowed."""


class DataNotFoundError(FedMosaicError, FileNotFoundError):
    """Dataset files are missing; the message says which files to put where."""


class CorruptDataError(FedMosaicError):
    """A dataset file exists but is truncated or corrupt; the message names the file."""
