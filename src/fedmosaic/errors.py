"""User-facing errors: the CLI prints these as one line, without a traceback."""


class FedMosaicError(Exception):
    """A mistake in user input or environment (bad config, missing files) — not a bug."""

    exit_code = 2


class ConfigError(FedMosaicError, ValueError):
    """An invalid parameter; the message names the parameter and what is allowed."""


class DataNotFoundError(FedMosaicError, FileNotFoundError):
    """Dataset files are missing; the message says which files to put where."""


class CorruptDataError(FedMosaicError):
    """A dataset file exists but is truncated or corrupt; the message names the file."""


class RunError(FedMosaicError):
    """A run stopped by its environment (disk full, permissions) or by divergence. Its directory keeps every round
    finished before, and ``fedmosaic run --resume`` continues it; ``amend`` suggests a ``--set`` for that resume."""

    def __init__(self, message: str, amend: str | None = None, diverged: int | None = None):
        super().__init__(message)
        self.amend = amend
        self.diverged = diverged  # the round whose loss or update was not finite, for a divergence


class Stopped(FedMosaicError):
    """Stopped by a signal (SIGINT, SIGTERM); the exit status is 128 + the signal number, as a shell reports it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def environment_error(exc: BaseException) -> str | None:
    """One line for a failure of the machine rather than of fedmosaic (a file that cannot be written, memory that
    cannot be had), or None for anything else."""
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    oom = isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("can't allocate memory", "out of memory"))
    )
    if oom:
        return ("out of memory; lower train.batch_size, engine.chunk_size (clients trained at once) or the model "
                "size, or use engine.backend: sequential")
    return None


def one_line(text, limit: int = 1000) -> str:
    """``text`` as one line (whitespace runs and control characters, a terminal's escapes among them, folded into
    one space), cut to ``limit`` characters with "..."."""
    text = " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ClientsLost(FedMosaicError):
    """A pool lost some of its clients' state with the process that held it (a Ray actor killed, its node gone):
    the run replays from its last checkpoint (``engine.ray.restarts`` times at most)."""
