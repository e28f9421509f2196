"""The fleet gateway: the only door of a deployment that nodes may knock on.

Flower 1.42's SuperLink serves every API — the nodes' Fleet API, the Control API (register nodes, start, stop and list
runs) and the Runtime API — on one address and port, and without Flower's enterprise module it authenticates no caller
of the Control API: whoever reaches that port and trusts its certificate can register a node, run their own ServerApp
on the server, stop the operator's run (docs/design.md "Deployment: who can do what"). So ``fedmosaic deploy`` binds
the SuperLink to the server's loopback and puts this gateway on the address the nodes reach: it terminates TLS with
the SuperLink's certificate and forwards the Fleet API's node operations alone (``FLEET``, POST) to the SuperLink
over TLS on loopback; anything else is refused with 403 and a one-line reason, before it reaches the SuperLink. A
node's own authentication (its registered key signs every Fleet request's headers) passes through unchanged; with
``--node-keys`` (``commands.sh`` gives the app's ``node_keys.json``) the gateway checks it first, before it reads a
byte of the body: a caller whose key is not the deployment's, whose signature of the timestamp does not verify or
whose timestamp is stale gets 401 (its activation goes on to the SuperLink, body capped at 64 KiB, to be refused
there in Flower's words), so only the deployment's nodes can make it hold a body larger than that. Nor can a caller
hold a connection for free (uvicorn bounds none of this: a half-sent head held a socket for ever): its request head
must be whole ``HEAD_S`` seconds after its TLS handshake (which asyncio bounds at 60 s) or after the last answer on
it, its body must keep coming at ``RATE`` bytes a second after a start of ``GRACE_S``, and an answer it does not read
for ``HEAD_S`` seconds (pipelined requests, never read) ends the connection.

Run as ``fedmosaic gateway --listen HOST:PORT --superlink 127.0.0.1:PORT --certfile ... --keyfile ... --ca ...``
(``commands.sh`` does).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..errors import FedMosaicError

#: the Fleet API's calls a registered node makes (flwr 1.42, ``superlink/routers/fleet/router.py``); node
#: self-registration is not among them (the SuperLink refuses it under --enable-supernode-auth anyway)
FLEET = frozenset(f"/v1/fleet/{op}" for op in (
    "activate-node", "deactivate-node", "send-node-heartbeat", "pull-messages", "push-messages", "get-run",
    "get-fab", "push-object", "pull-object", "confirm-message-received"))
#: request headers passed on (the node's signature headers among them); hop-by-hop ones and Host are not
_DROP = frozenset(("host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                   "proxy-authorization", "proxy-connection", "content-length"))
REFUSED = "refused by the fleet gateway: only the Fleet API's node operations are served on this address"
#: the request bodies the gateway reads itself before it forwards them (``check_push``)
PUSH = "/v1/fleet/push-messages"
#: with node keys, the one call forwarded unsigned by them, its body at most SMALL bytes: a node whose key is not
#: registered then hears the SuperLink's own refusal ("Failed to activate SuperNode"), not a 401 that Flower's
#: SuperNode takes for a graceful end
ACTIVATE, SMALL = "/v1/fleet/activate-node", 64 * 1024
#: seconds a connection may take to send a whole request head; a body's deadline is GRACE_S + its bytes / RATE (16 KiB
#: a second: a 128 kbit/s link; a 100 MB reply gets 1.7 h)
HEAD_S, GRACE_S, RATE = 30.0, 30.0, 16 * 1024


def check_push(body: bytes) -> str | None:
    """Why a node's push-messages body is refused, or None. A node pushes replies, nothing else: Flower 1.42's
    SuperLink stores a pushed message without ``reply_to`` as an *instruction* for the node it names, checking only
    that its source claims to be the SuperLink (which the sender writes itself), so one registered node could make
    another run a forged request. Each message must answer an instruction (``reply_to``), come from the calling node
    (the one its signature authenticates) and go to the SuperLink; and its object tree must be a reply's
    (:func:`_odd_tree`)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from google.protobuf.message import DecodeError

    try:
        req = PushMessagesRequest.FromString(body)
    except (DecodeError, ValueError):
        return "push-messages: the body is not a PushMessagesRequest"
    if not req.messages_list:
        return "push-messages without a message"
    if len(req.messages_list) != 1 or len(req.message_object_trees) != 1:
        return "push-messages with other than one message and its object tree"  # (Flower stores the first alone)
    if (why := _odd_tree(req.message_object_trees[0])) is not None:
        return why
    for m in req.messages_list:
        meta = m.metadata
        if not meta.reply_to_message_id:
            return "a node pushes replies only; a message that answers no instruction is one for another node"
        if meta.src_node_id != req.node.node_id:
            return f"a reply from node {meta.src_node_id} pushed by node {req.node.node_id}"
        if meta.dst_node_id != SUPERLINK_NODE_ID:
            return f"a reply addressed to node {meta.dst_node_id}, not to the SuperLink"
    return None


def _odd_tree(tree) -> str | None:
    """Why a reply's object tree is not a fedmosaic reply's, or None. The SuperLink pre-registers every object a
    pushed tree names, with no bound on their count, then takes one push-object of each (each under the body cap), and
    the ServerApp pulls the whole tree before it can judge the reply: a node naming thousands of objects could make
    both hold as many bodies. A reply is a message, its RecordDict and the one ConfigRecord ``common.RECORD`` (a
    ConfigRecord is one object, its bytes never chunked), or an error message alone: a chain of at most 3."""
    depth = 0
    while tree.children:
        if len(tree.children) > 1 or depth == 2:
            return "a reply's object tree is not a message, its RecordDict and one ConfigRecord"
        tree, depth = tree.children[0], depth + 1
    return None


def node_keys(path: str | Path):
    """A function giving the DER public keys of the deployment's nodes from ``path`` (``node_keys.json``: client
    id -> PEM), read again when the file changes (a node added later is registered and added to it)."""
    from cryptography.hazmat.primitives import serialization

    path, seen = Path(path), {}

    def keys() -> frozenset[bytes]:
        try:
            stamp = path.stat().st_mtime_ns
            if seen.get("stamp") != stamp:
                seen.update(stamp=stamp, keys=frozenset(
                    serialization.load_pem_public_key(pem.encode()).public_bytes(
                        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
                    for pem in json.loads(path.read_text()).values()))
        except (OSError, ValueError, TypeError, AttributeError):
            if "keys" not in seen:  # (at start: one line from the CLI)
                raise
            seen.pop("stamp")  # a file being rewritten: the keys read before, until it reads whole
        return seen["keys"]
    return keys


def unsigned(headers, keys: frozenset[bytes]) -> str | None:
    """Why a Fleet request does not come from one of the nodes ``keys``, or None: Flower's own check (its node
    authentication: the timestamp header signed by the key it names, fresh within Flower's window), with the key
    one of the deployment's. (The SuperLink checks the same, and that the key is the node id's, after this.)"""
    import base64
    import binascii
    import datetime

    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from flwr.common.constant import SYSTEM_TIME_TOLERANCE, TIMESTAMP_HEADER, TIMESTAMP_TOLERANCE
    from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key, verify_signature

    try:
        key = bytes_to_public_key(base64.b64decode(headers[FLEET_HTTP_PUBLIC_KEY_HEADER], validate=True))
        signature = base64.b64decode(headers[FLEET_HTTP_SIGNATURE_HEADER], validate=True)
        stamp = headers[TIMESTAMP_HEADER]
        age = (datetime.datetime.now(datetime.UTC) - datetime.datetime.fromisoformat(stamp)).total_seconds()
    except (KeyError, ValueError, TypeError, binascii.Error, UnsupportedAlgorithm):
        return "no node's signature (Flower's node authentication headers)"
    if key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) not in keys:
        return "the key is not one of this deployment's nodes"  # (so an EC key of ours: Flower's verify applies)
    if not -SYSTEM_TIME_TOLERANCE < age < TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE:
        return "the signed timestamp is not fresh"
    try:
        signed = verify_signature(key, stamp.encode("ascii"), signature)
    except (UnicodeError, ValueError):
        signed = False
    return None if signed else "the signature does not verify"


def make_app(superlink: str, ca: str, max_body_mb: float = 1024.0, keys=None, grace_s: float = GRACE_S,
             rate: float = RATE):
    """The gateway's ASGI app, forwarding to ``https://<superlink>`` verified against the CA file ``ca``. A body
    over ``max_body_mb`` is refused whether it declares its length or streams in chunks (read up to the limit), one
    that does not arrive within ``grace_s + bytes / rate`` seconds too (408). ``keys`` (:func:`node_keys`): only
    requests signed by one of these nodes are read (and unsigned activations, up to 64 KiB: ``ACTIVATE``)."""
    import asyncio
    import time

    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=f"https://{superlink}", verify=ca, timeout=httpx.Timeout(120.0))
    limit = int(max_body_mb * 2**20)
    too_big = f"refused by the fleet gateway: a body over {max_body_mb:g} MB\n"
    too_big_unsigned = f"refused by the fleet gateway: an unsigned activation over {SMALL // 1024} KiB\n"
    slow = f"refused by the fleet gateway: a body slower than {rate / 1024:g} KiB/s after {grace_s:g} s\n"

    async def forward(request: Request) -> Response:
        path = request.url.path
        if request.method != "POST" or path not in FLEET:
            return PlainTextResponse(f"{REFUSED} ({request.method} {path[:100]})\n", status_code=403)
        why = unsigned(request.headers, keys()) if keys is not None else None
        if why and path != ACTIVATE:
            return PlainTextResponse(f"refused by the fleet gateway: {why}\n", status_code=401)
        cap, big = (SMALL, too_big_unsigned) if why else (limit, too_big)  # (unsigned: an activation, see ACTIVATE)
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            return PlainTextResponse(big, 413)
        body, chunks, start = bytearray(), request.stream(), time.monotonic()
        while True:  # chunked bodies too: never more than the limit held, nor for longer than its deadline
            try:
                left = start + grace_s + len(body) / rate - time.monotonic()
                body += await asyncio.wait_for(anext(chunks), max(left, 0.0))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:  # (TimeoutError from Python 3.11 on, not before)
                return PlainTextResponse(slow, 408)
            if len(body) > cap:
                return PlainTextResponse(big, 413)
        body = bytes(body)
        why = check_push(body) if path == PUSH else None
        if why:
            return PlainTextResponse(f"refused by the fleet gateway: {why}\n", status_code=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        try:
            r = await client.post(path, content=body, headers=headers)
        except httpx.HTTPError as e:
            return PlainTextResponse(f"the SuperLink behind the gateway did not answer: {type(e).__name__}\n", 502)
        out = {k: v for k, v in r.headers.items() if k.lower() not in _DROP | {"content-encoding"}}
        return Response(r.content, status_code=r.status_code, headers=out)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def server(listen: str, superlink: str, certfile: str, keyfile: str, ca: str, max_body_mb: float = 1024,
           keys_file: str | None = None, head_s: float = HEAD_S, **app):
    """The gateway's uvicorn server on ``listen`` (HOST:PORT, IPv6 in brackets); ``app``: :func:`make_app`'s
    deadlines."""
    import uvicorn

    host, port = split_address(listen)
    keys = node_keys(keys_file) if keys_file else None
    return uvicorn.Server(uvicorn.Config(
        make_app(superlink, ca, max_body_mb, keys, **app), host=host, port=port, ssl_certfile=certfile,
        ssl_keyfile=keyfile, log_level="warning", workers=1, http=head_deadline(head_s)))


def check_listening(listen: str, certfile: str, keyfile: str, ca: str) -> None:
    """One line (before uvicorn, whose own failures are a log line and exit 1) where the gateway could not serve:
    a certificate and key that do not load as a pair, a CA file that is no certificate, an address in use."""
    import socket
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, ValueError) as e:
        raise FedMosaicError(f"gateway: --certfile {certfile} and --keyfile {keyfile} do not load as a PEM "
                             f"certificate and its private key ({getattr(e, 'reason', None) or e})") from None
    try:
        ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, ValueError) as e:
        raise FedMosaicError(f"gateway: --ca {ca} is not a PEM certificate ({getattr(e, 'reason', None) or e})") \
            from None
    host, port = split_address(listen)
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as e:
        raise FedMosaicError(f"gateway: cannot listen on {listen}: {e.strerror or e}") from None


def serve(*args, **kwargs) -> None:
    """Serve the gateway (:func:`server`'s arguments) until stopped."""
    server(*args, **kwargs).run()


def head_deadline(head_s: float):
    """uvicorn's HTTP/1.1 protocol, dropping a connection on which no request is being answered ``head_s`` seconds
    after it opened or after its last answer (a request head not whole by then, or a body still trickling in after
    the answer: uvicorn waits for a head for ever and keeps reading a refused body), or whose answer the caller has
    not read for ``head_s`` seconds (its writes paused all that time)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        deadline = paused_at = None

        def pause_writing(self) -> None:
            self.paused_at = self.loop.time()
            super().pause_writing()

        def resume_writing(self) -> None:
            self.paused_at = None
            super().resume_writing()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            if not self.transport.is_closing():
                self.deadline = self.loop.call_later(head_s, self._late)

        def _late(self) -> None:
            if self.transport.is_closing():
                return
            answering = self.cycle is not None and not self.cycle.response_complete
            if answering and (self.paused_at is None or self.loop.time() - self.paused_at < head_s):
                self._arm()  # (a request being answered, its answer read: looked at again later)
            else:  # (abort: a close would wait for a TLS goodbye the caller need not send)
                self.transport.abort()

    return HeadDeadline


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
