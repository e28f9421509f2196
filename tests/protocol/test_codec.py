"""The codec: any message body round-trips bit for bit, its size is known without encoding it, real payloads of
every family travel, and anything malformed is one CorruptDataError line."""

from __future__ import annotations

import random

import pytest
import torch
from fedtest import BLOBS6, PROTOCOL_CASES, merged, with_overrides

from fedmosaic.errors import CorruptDataError
from fedmosaic.protocol import codec
from fedmosaic.protocol.tree import leaves
from fedmosaic.setup.world import build_federation


def same(a, b) -> bool:
    """Equal in structure, types and bits (NaN payloads and signed zeros included); ``b`` decoded on the CPU,
    ``a`` wherever the run keeps it."""
    if isinstance(a, torch.Tensor):
        a = a.cpu()
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and b.is_contiguous()
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a,
                                b.reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def every_kind_of_body():
    g = torch.Generator().manual_seed(0)
    odd = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    return {
        "weights": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g).double()},
        "dtypes": [torch.randn(5, generator=g).to(d) for d in (torch.float16, torch.bfloat16, torch.complex64)]
        + [torch.arange(-3, 3, dtype=d) for d in (torch.int8, torch.int16, torch.int32, torch.int64)]
        + [torch.tensor([0, 255], dtype=torch.uint8), torch.tensor([True, False, True])],
        "odd": (odd, odd.bfloat16(), torch.tensor(2.5), torch.empty(0, 7), torch.randn(4, 3, generator=g).T),
        "scalars": {"round": 3, "lr": 0.01, "refresh": True, "name": "fedavg", "none": None, "inf": float("inf"),
                    "nan": float("nan"), "neg": -float("inf")},
        "": [[], {}, ()],
    }


def test_any_body_round_trips_bit_for_bit_and_its_size_is_known():
    body = every_kind_of_body()
    data = codec.encode("upload", body)
    assert codec.size("upload", body) == len(data)
    kind, back = codec.decode(data, "upload")
    assert kind == "upload" and same(body, back)
    assert same(body, codec.decode(memoryview(bytearray(data)))[1])  # any buffer


def test_what_cannot_travel_is_named():
    with pytest.raises(TypeError, match=r"body\.x\[1\]: a set cannot travel"):
        codec.encode("b", {"x": [1, {2}]})
    with pytest.raises(TypeError, match="dict keys must be strings"):
        codec.encode("b", {1: torch.zeros(1)})


# ---- real payloads of each family ---------------------------------------------------------------------------------
@pytest.mark.parametrize("algo, over", PROTOCOL_CASES, ids=[c[0]["name"] for c in PROTOCOL_CASES])
def test_every_familys_payloads_and_state_travel_exactly(algo, over):
    raw = merged({**BLOBS6, "algorithm": algo, "train": {**BLOBS6["train"], "rounds": 2}}, over)
    fed = build_federation(with_overrides(raw))
    for t in range(2):
        fed.round(t)
    cohort = torch.as_tensor(fed.cohort(1))
    bodies = {"broadcast": fed.algo.broadcast(fed.server, 1),
              "assignment": fed.algo.client_payload(fed.server, cohort),
              "state": fed.state_dict()}
    assert leaves(bodies["state"])
    for kind, body in bodies.items():
        data = codec.encode(kind, body)
        assert len(data) == codec.size(kind, body)
        assert same(body, codec.decode(data, kind)[1]), kind


# ---- malformed messages ---------------------------------------------------------------------------------------------
# seeded: xdist's workers must collect the same parameters (a GPU image's plugins seed torch's global generator)
W = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
MESSAGE = codec.encode("upload", {"model": {"w": W}, "n": torch.tensor([5]), "ok": torch.ones(2) > 0})


@pytest.mark.parametrize("data, why", [
    (b"", "shorter than the 9-byte prefix"),
    (b"XMSG" + MESSAGE[4:], "does not start with b'FMSG'"),
    (MESSAGE[:4] + b"\x09" + MESSAGE[5:], "format version 9"),
    (MESSAGE + b"\x00", "1 bytes after its last tensor"),
    (MESSAGE[:-1], "truncated"),
    (MESSAGE[:9] + b"#" + MESSAGE[10:], "not JSON"),
])
def test_a_malformed_message_is_one_line(data, why):
    with pytest.raises(CorruptDataError, match=why) as e:
        codec.decode(data)
    assert str(e.value).startswith("malformed message: ") and "\n" not in str(e.value)


def forged(**change) -> bytes:
    """MESSAGE with its JSON header edited."""
    import json

    n = int.from_bytes(MESSAGE[5:9], "little")
    header = json.loads(MESSAGE[9 : 9 + n])
    for key, value in change.items():
        header[key] = value(header[key]) if callable(value) else value
    text = json.dumps(header).encode()
    return MESSAGE[:5] + len(text).to_bytes(4, "little") + text + MESSAGE[9 + n:]


@pytest.mark.parametrize("data, why", [
    (forged(kind="broadcast"), "a 'broadcast' message where a 'upload' message was expected"),
    (forged(tensors=lambda ts: [["float128", *ts[0][1:]], *ts[1:]]), "unknown dtype 'float128'"),
    (forged(tensors=lambda ts: [[ts[0][0], [3, 3], ts[0][2]], *ts[1:]]), r"shape \[3, 3\] of float32 needs 36"),
    (forged(tensors=lambda ts: [ts[0], ["int64", [2], 16], ts[2]]), "needs|after its last tensor|ends at"),
    (forged(body={"@": 0}), "2 of its tensors are not in its body"),
    (forged(body={"{}": {"a": {"@": 0}, "b": {"@": 0}}}), "tensor 0 appears twice"),
    (forged(body={"{}": {"a": {"@": 7}}}), r"body\.a: .* is not a tensor"),
    (forged(extra=1), "not {kind, body, tensors}"),
])
def test_a_forged_header_is_refused_in_one_line(data, why):
    with pytest.raises(CorruptDataError, match=why):
        codec.decode(data, "upload")


def test_a_bool_tensor_holds_only_0_and_1():
    assert MESSAGE[-2:] == b"\x01\x01"
    with pytest.raises(CorruptDataError, match="bool tensor holds bytes other than 0 and 1"):
        codec.decode(MESSAGE[:-1] + b"\x02")


def test_every_cut_and_flipped_byte_decodes_or_is_refused_never_crashes():
    rng = random.Random(0)
    cases = [MESSAGE[:k] for k in range(len(MESSAGE))]
    for _ in range(400):
        flipped = bytearray(MESSAGE)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        cases.append(bytes(flipped))
    for data in cases:
        try:
            codec.decode(data)
        except CorruptDataError as e:
            assert "\n" not in str(e)
