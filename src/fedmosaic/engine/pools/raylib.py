"""Ray itself, as fedmosaic uses it: imported with fedmosaic's defaults (no usage statistics; a cluster that
does not answer fails in seconds), the socket-path limit checked before Ray starts, and tensors through the object
store as numpy arrays."""

from __future__ import annotations

import os

import torch

from ...errors import FedMosaicError

#: Ray's defaults changed here: no usage statistics sent home (Ray's own default is on)
ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


#: Ray's sockets live under $RAY_TMPDIR (else $TMPDIR, else /tmp)/ray/session_<time>_<pid>/sockets/: a Unix socket's
#: path holds at most 107 bytes
SOCKET_PATH_MAX = 107


SESSION_NAME = "session_2026-01-01_00-00-00_000000_1234567"


def check_socket_path() -> None:
    import tempfile

    base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    longest = os.path.join(base, "ray", SESSION_NAME, "sockets", "plasma_store")
    if len(longest.encode()) > SOCKET_PATH_MAX:
        room = SOCKET_PATH_MAX - (len(longest.encode()) - len(base.encode()))
        raise FedMosaicError(f"the temporary folder {base} is too long for Ray's sockets ({len(base.encode())} "
                             f"bytes; at most {room}): set RAY_TMPDIR to a shorter folder, e.g. RAY_TMPDIR=/tmp")


#: connecting to a cluster address: fail in seconds, not after Ray's ~15 minutes of retries
CONNECT_ENV = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_py_gcs_connect_timeout_s": "5",
               "RAY_gcs_rpc_server_connect_timeout_s": "3"}


def ray_module():
    """The ``ray`` package, or one line saying how to install it."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    try:
        import ray
    except ImportError:
        raise FedMosaicError("engine.pool: ray needs Ray: pip install 'fedmosaic[ray]'") from None
    return ray


# ---- tensors through the object store -----------------------------------------------------------------------
def _to_numpy(t: torch.Tensor):
    """A tensor as a numpy array (Ray moves those as out-of-band buffers: ~10x faster than torch's pickling);
    bfloat16, which numpy lacks, as its bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return "bfloat16", t.view(torch.int16).numpy()
    return None, t.numpy()


def _from_numpy(packed) -> torch.Tensor:
    """Back to a tensor, copied: an array read from the object store is shared memory that an in-place update
    would change for every reader."""
    kind, a = packed
    t = torch.from_numpy(a.copy())
    return t.view(torch.bfloat16) if kind == "bfloat16" else t


def register_tensors(ray) -> None:
    """Pass tensors as numpy arrays in this process's messages (the driver and every actor register it)."""
    ray.util.register_serializer(torch.Tensor, serializer=_to_numpy, deserializer=_from_numpy)


