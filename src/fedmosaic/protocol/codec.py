"""Messages as bytes: what crosses between a server and its clients when they are not in one process.

A message is a ``kind`` (what it is: ``"broadcast"``, ``"upload"``, ...) and a ``body``: any nesting of dicts (string
keys), lists and tuples whose leaves are tensors, Python scalars (bool, int, float, str) or None — an algorithm's
payload, upload or state as the engine holds them. On the wire::

    b"FMSG" | u8 version | u32 header length | JSON header | the tensors' bytes, one after another (little-endian)

The JSON header holds the kind, the body's structure with every tensor replaced by ``{"@": i}``, and per tensor its
dtype, shape and byte count, so the bytes after it are nothing but raw little-endian tensor data (no pickle: decoding
runs no code). :func:`decode` checks every one of them and turns anything malformed (a truncated or padded message,
an unknown dtype, a shape that does not match its bytes, another kind than expected) into one
:class:`~fedmosaic.errors.CorruptDataError` line, never a failure deep in training. Tensors come back on the CPU,
contiguous, with their dtype and shape; a round trip is exact (bit for bit, NaN payloads and signed zeros too).
"""

from __future__ import annotations

import json
import math
import struct
import sys

import torch

from ..errors import CorruptDataError, FedMosaicError
from .tree import nbytes

MAGIC, VERSION = b"FMSG", 1
_PREFIX = struct.Struct("<4sBI")  # magic, version, header length
#: the dtypes a message may carry, by the name it travels under
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}
MAX_HEADER = 64 << 20  # a header is structure and shapes: far below this, unless the message is garbage
SCALARS = (bool, int, float, str, type(None))


def encode(kind: str, body) -> bytes:
    """``body`` (see the module) as one message of ``kind``."""
    header, tensors = _header(kind, body)
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(header)), header, *map(tensor_bytes, tensors)])


def size(kind: str, body) -> int:
    """``len(encode(kind, body))``, without copying a tensor's bytes."""
    header, tensors = _header(kind, body)
    return _PREFIX.size + len(header) + nbytes(tensors)


def decode(data: bytes | bytearray | memoryview, kind: str | None = None):
    """``(kind, body)`` of a message made by :func:`encode`; with ``kind``, a message of another kind is refused."""
    _little_endian()
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size:
        raise _corrupt(f"{len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise _corrupt(f"it does not start with {MAGIC!r} (got {bytes(magic)!r}): not a fedmosaic message")
    if version != VERSION:
        raise _corrupt(f"format version {version}; this fedmosaic reads version {VERSION}")
    if length > min(MAX_HEADER, len(data) - _PREFIX.size):
        raise _corrupt(f"its header claims {length} bytes but {len(data) - _PREFIX.size} follow the prefix")
    try:
        header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(f"its header is not JSON ({e})") from None
    if not (isinstance(header, dict) and set(header) == {"kind", "body", "tensors"} and isinstance(header["kind"], str)
            and isinstance(header["tensors"], list)):
        raise _corrupt("its header is not {kind, body, tensors}")
    if kind is not None and header["kind"] != kind:
        raise _corrupt(f"a {header['kind']!r} message where a {kind!r} message was expected")
    offset, tensors = _PREFIX.size + length, []
    for i, spec in enumerate(header["tensors"]):
        t = _tensor(spec, i, data, offset)
        offset += spec[2]
        tensors.append(t)
    if offset != len(data):
        raise _corrupt(f"{len(data) - offset} bytes after its last tensor (a message is {offset} bytes)")
    used: set[int] = set()
    body = _build(header["body"], tensors, used, "body")
    if len(used) != len(tensors):
        raise _corrupt(f"{len(tensors) - len(used)} of its tensors are not in its body")
    return header["kind"], body


# ---- encoding ------------------------------------------------------------------------------------------------------
def _header(kind: str, body) -> tuple[bytes, list[torch.Tensor]]:
    _little_endian()
    tensors: list[torch.Tensor] = []
    header = {"kind": kind, "body": _structure(body, tensors, "body"),
              "tensors": [[_dtype_name(t), list(t.shape), nbytes(t)] for t in tensors]}
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode(), tensors


def _little_endian() -> None:
    if sys.byteorder != "little":  # every tensor's bytes travel as they lie in memory
        raise FedMosaicError("messages need a little-endian host (x86-64, ARM); this one is big-endian")


def _structure(node, tensors: list, where: str):
    if isinstance(node, torch.Tensor):
        if node.dtype not in DTYPES.values():
            raise TypeError(f"{where}: a {node.dtype} tensor cannot travel (dtypes: {', '.join(DTYPES)})")
        tensors.append(node)
        return {"@": len(tensors) - 1}
    if isinstance(node, dict):
        if not all(isinstance(k, str) for k in node):
            raise TypeError(f"{where}: dict keys must be strings (got {[type(k).__name__ for k in node]})")
        return {"{}": {k: _structure(v, tensors, f"{where}.{k}") for k, v in node.items()}}
    if isinstance(node, (list, tuple)):
        return {"()" if isinstance(node, tuple) else "[]": [_structure(v, tensors, f"{where}[{i}]")
                                                            for i, v in enumerate(node)]}
    if isinstance(node, float) and not math.isfinite(node):
        return {"float": repr(node)}  # JSON has no inf/nan
    if isinstance(node, SCALARS):
        return node
    raise TypeError(f"{where}: a {type(node).__name__} cannot travel in a message (tensors, dicts, lists, tuples, "
                    "bool, int, float, str, None)")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` as they travel: its elements in order, on the CPU, bools as one byte 0 or 1."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return (flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)).numpy().tobytes()


# ---- decoding ------------------------------------------------------------------------------------------------------
def _corrupt(why: str) -> CorruptDataError:
    return CorruptDataError(f"malformed message: {why}")


def _tensor(spec, i: int, data: memoryview, offset: int) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[1], list)
            and all(type(d) is int and d >= 0 for d in spec[1]) and type(spec[2]) is int and spec[2] >= 0):
        raise _corrupt(f"tensor {i}: its description {str(spec)[:80]} is not [dtype, shape, bytes]")
    name, shape, nbytes = spec
    dtype = DTYPES.get(name)
    if dtype is None:
        raise _corrupt(f"tensor {i}: unknown dtype {name[:40]!r} (known: {', '.join(DTYPES)})")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if math.prod(shape) * itemsize != nbytes:
        raise _corrupt(f"tensor {i}: shape {shape} of {name} needs {math.prod(shape) * itemsize} bytes, not {nbytes}")
    if offset + nbytes > len(data):
        raise _corrupt(f"tensor {i}: {nbytes} bytes from offset {offset}, but the message ends at {len(data)} "
                       "(truncated?)")
    raw = torch.frombuffer(bytearray(data[offset : offset + nbytes]), dtype=torch.uint8) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        if nbytes and int(raw.max()) > 1:
            raise _corrupt(f"tensor {i}: a bool tensor holds bytes other than 0 and 1")
        return raw.to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def _build(node, tensors: list, used: set, where: str):
    if isinstance(node, SCALARS):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, value), = node.items()
        if tag == "@" and type(value) is int and 0 <= value < len(tensors):
            if value in used:
                raise _corrupt(f"{where}: tensor {value} appears twice")
            used.add(value)
            return tensors[value]
        if tag == "{}" and isinstance(value, dict):
            return {k: _build(v, tensors, used, f"{where}.{k}") for k, v in value.items()}
        if tag in ("[]", "()") and isinstance(value, list):
            items = [_build(v, tensors, used, f"{where}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if tag == "()" else items
        if tag == "float" and value in ("inf", "-inf", "nan"):
            return float(value)
    raise _corrupt(f"{where}: {json.dumps(node)[:80]} is not a tensor, dict, list, tuple or scalar of a message")
