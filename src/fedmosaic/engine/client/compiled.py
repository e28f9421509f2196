"""torch.compile with a way out: a compiled function that falls back to eager once compiling fails on this
machine (one warning), and the errors that mean "cannot compile" rather than "the code is wrong"."""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch


class CompiledOrEager:
    """``torch.compile(fn)``, or ``fn`` itself once compiling has failed here (no working compiler for this device,
    a GPU Triton cannot target): one warning per trainer (``failed`` is shared by its compiled functions), and the
    run goes on eagerly — the same arithmetic, without the compiled speed. A compile fails before the graph runs,
    so nothing was updated in place and the eager call repeats nothing."""

    def __init__(self, fn, failed: list):
        self.fn, self.compiled, self.failed = fn, torch.compile(fn, dynamic=False), failed

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as e:
                if not isinstance(e, compile_errors()):
                    raise
                cause = getattr(e, "inner_exception", None) or e
                first = (str(cause).strip().splitlines() or [""])[0][:300]
                self.failed.append(f"{type(cause).__name__}: {first}")
                warnings.warn(f"engine.compile: torch.compile failed on this machine ({self.failed[0]}); training "
                              "goes on without compiling (set engine.compile: false to skip the attempt)",
                              stacklevel=2)
        return self.fn(*args)


@functools.cache
def compile_errors() -> tuple[type, ...]:
    """What torch raises when it cannot compile (as opposed to an error in the code being compiled)."""
    from torch._dynamo.exc import BackendCompilerFailed

    errors: list[type] = [BackendCompilerFailed]
    with contextlib.suppress(ImportError):
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    return tuple(errors)


