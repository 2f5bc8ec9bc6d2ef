"""Attacks on the HTTP gateway in front of a real secure mesh (nats-server, three shard hosts, an orchestrator,
`hearth gateway`), as a client or a member of the mesh would try them: a slow client that never finishes its
request, one API key opening more calls than its limit, junk published on a call's inbox, and scraping /metrics
from another machine. Each is refused or harmless."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT
from hearth.services.broker.connection import connect_nats, flush_ordered
from hearth.services.gateway.keys import create_api_key
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROMPT = "the quick brown fox"
HTTP_WAIT_S = 60
# What the tuned gateway is started with: a short request deadline and one open call per member.
READ_TIMEOUT_S = 2
# How long a test waits, at most, for the tuned gateway to close a stalled connection (well above the deadline).
DISCONNECT_WAIT_S = 60
MEMBERS = ("alice", "bob")
# Messages that are no frame (and one frame of a type no client knows), published on a call's inbox.
JUNK = (b"not json", b"[1, 2]", b'{"seq": 0}', b'{"type": "token_delta", "seq": 0}', b'{"type": "from-the-future"}')


class GatewayMesh:
    def __init__(self, cluster, keys: dict[str, str]) -> None:
        self.cluster = cluster
        self.keys = keys


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_models_dir) -> Iterator[GatewayMesh]:
    with three_shard_mesh(tmp_path_factory.mktemp("gateway-attacks"), tiny_models_dir) as cluster:
        keys = {name: create_api_key(cluster.member_key(name, "client").parents[1], name) for name in MEMBERS}
        yield GatewayMesh(cluster, keys)


@pytest.fixture(scope="module")
def gateway(mesh):
    """A gateway with the default settings."""
    return mesh.cluster.start_gateway()


@pytest.fixture(scope="module")
def tuned_gateway(mesh):
    """A gateway with a short request deadline and a limit of one open call per member."""
    return mesh.cluster.start_gateway(name="tuned-gateway", env={
        "HEARTH_GATEWAY__REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        "HEARTH_GATEWAY__MAX_OPEN_REQUESTS_PER_CALLER": "1"})


def chat_body(**changes) -> dict:
    return {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0, **changes}


def post(url: str, body: dict, api_key: str) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one POST /v1/chat/completions (a body that is no JSON as {"text": ...})."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_WAIT_S) as response:
            return response.status, dict(response.headers), json_or_text(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json_or_text(error.read())


def json_or_text(data: bytes) -> dict:
    try:
        return json.loads(data)
    except ValueError:
        return {"text": data.decode(errors="replace")}


def address_of(process) -> tuple[str, int]:
    host, _, port = process.ready_file.read_text().removeprefix("http://").rpartition(":")
    return host, int(port)


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    received = b""
    while piece := connection.recv(4096):
        received += piece
    return received


@pytest.mark.parametrize("sent, answer", [
    # No head yet: answered 408 and closed.
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthoriz", b"HTTP/1.1 408 "),
    # The head in, with a key, and part of the body: the call is dropped and the connection closed.
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ", b""),
], ids=["half-a-header-line", "half-a-body"])
def test_a_slow_client_is_disconnected_at_the_request_deadline(mesh, tuned_gateway, sent, answer):
    with socket.create_connection(address_of(tuned_gateway), timeout=DISCONNECT_WAIT_S) as connection:
        connection.sendall(sent.replace(b"{key}", mesh.keys["alice"].encode()))
        received = read_until_closed(connection)  # it stalls: the gateway must end it
    assert received.startswith(answer) and (answer or received == b""), received
    # The gateway still serves everyone else.
    assert post(tuned_gateway.ready_file.read_text(), chat_body(), mesh.keys["bob"])[0] == 200


def test_one_key_over_its_limit_gets_429_while_another_key_is_served(mesh, tuned_gateway):
    url = tuned_gateway.ready_file.read_text()
    body = json.dumps(chat_body(max_tokens=500, stream=True)).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {mesh.keys['alice']}"})
    # Greedy and long, so that alice's open call cannot end before the others are made.
    with urllib.request.urlopen(request, timeout=HTTP_WAIT_S) as stream:
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        status, headers, refused = post(url, chat_body(), mesh.keys["alice"])
        assert status == 429, refused
        assert int(headers["retry-after"]) >= 1
        assert (refused["error"]["code"], refused["error"]["type"]) == ("overloaded", "rate_limit_error")
        assert "max_open_requests_per_caller" in refused["error"]["message"]
        status, _, answer = post(url, chat_body(), mesh.keys["bob"])
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer


async def test_junk_on_a_calls_inbox_is_skipped_and_the_call_completes(mesh, gateway):
    """The steward (`system`) sees the gateway's call and publishes junk on its inbox before the answer."""
    nc = await connect_nats(mesh.cluster.nats_url, name="inbox-junk", settings=mesh.cluster.nats_settings())
    injected = asyncio.Event()

    async def inject(message) -> None:
        if message.reply.startswith("_INBOX.gateway.") and not injected.is_set():
            for junk in JUNK:
                await nc.publish(message.reply, junk)
            await flush_ordered(nc)
            injected.set()

    try:
        await nc.subscribe(CHAT_REQUEST_SUBJECT, cb=inject)
        await flush_ordered(nc)
        status, _, answer = await asyncio.to_thread(post, gateway.ready_file.read_text(), chat_body(max_tokens=32),
                                                    mesh.keys["alice"])
        assert injected.is_set()
    finally:
        await nc.close()
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 32
    assert "Traceback" not in gateway.log_tail(100_000)


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not a loopback one (None when it has none)."""
    candidates = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # picks the outgoing interface; a UDP connect sends nothing
        candidates.append(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        candidates += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    return next((address for address in candidates if not address.startswith("127.")), None)


def test_metrics_are_not_reachable_from_another_machine(mesh, gateway):
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try /metrics on")
    urls = mesh.cluster.metrics_urls()
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=HTTP_WAIT_S) as response:  # served, on the loopback
            assert response.status == 200, name
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(ConnectionRefusedError), socket.create_connection((address, port), timeout=HTTP_WAIT_S):
            print(f"{name}'s /metrics answers on {address}:{port}")
    assert {name.split("-")[0] for name in urls} >= {"shard", "orchestrator", "gateway"}
