"""The gateway's defences without a mesh: the request deadline of its HTTP server (a real uvicorn on the loopback),
the per-member limit on open calls, CORS only for the origins configured (with the headers OpenAI's browser SDK
sends), and junk on a call's inbox skipped by the chat client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from hearth.services.client.chat import _decode_known
from hearth.services.common.config import HearthSettings
from hearth.services.gateway.app import create_app
from hearth.services.gateway.errors import GatewayError
from hearth.services.gateway.http_server import GatewayHttpServer, server_config, write_stall_timeouts_total
from hearth.protocol.chat import max_choices, max_messages, max_tokens_limit
from hearth.services.gateway.keys import Caller
from hearth.services.gateway.mesh import Gateway, MeshCall
from tests.unit.test_gateway_retry_hints import waits_as_named

# The server runs in the test's own event loop: a deadline shorter than a stall of that loop on a busy machine fired
# before the client's bytes were read, and closing over unread bytes resets the connection instead of ending it.
READ_TIMEOUT_S = 2.0
# Long enough for a slow reader's window to open again (TCP acknowledges it in steps of about half its buffer).
SLOW_READER_STALL_TIMEOUT_S = 1.5
# How long a test waits, at most, for the server to close a stalled connection (well above the deadline).
CLOSE_WAIT_S = 30


def gateway_with(**gateway_settings) -> Gateway:
    settings = HearthSettings(gateway=gateway_settings)
    return Gateway(SimpleNamespace(is_connected=True), settings, keyring=None)


@contextlib.asynccontextmanager
async def serving(gateway: Gateway, servers: list | None = None):
    """The gateway's app on uvicorn as `hearth gateway` configures it, on a free loopback port: its base URL (the
    uvicorn server appended to `servers`)."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = GatewayHttpServer(server_config(create_app(gateway), gateway.settings.gateway))
    if servers is not None:
        servers.append(server)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, CLOSE_WAIT_S)
        sock.close()


async def received_until_closed(address, sent: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(sent)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), CLOSE_WAIT_S)  # reads to EOF: the server must close
    finally:
        writer.close()


def get(address, path: str, headers: dict[str, str] | None = None, method: str = "GET"):
    request = urllib.request.Request(f"http://{address[0]}:{address[1]}{path}", headers=headers or {},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=CLOSE_WAIT_S) as response:
            return response.status, response.headers
    except urllib.error.HTTPError as error:
        return error.code, error.headers


async def test_a_request_head_that_never_ends_is_answered_408_and_closed():
    async with serving(gateway_with(request_read_timeout_s=READ_TIMEOUT_S)) as address:
        received = await received_until_closed(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\nAccept: te")
        assert received.startswith(b"HTTP/1.1 408 ")
        # A request that comes whole is served as before.
        assert (await asyncio.to_thread(get, address, "/healthz"))[0] == 200


async def test_a_body_that_never_ends_closes_the_connection():
    async with serving(gateway_with(request_read_timeout_s=READ_TIMEOUT_S)) as address:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"
        # On an open mesh no key is asked for, so the app waits for the body: the deadline ends it.
        assert await received_until_closed(address, head) == b""


async def test_an_idle_connection_is_closed_without_an_answer_of_its_own():
    async with serving(gateway_with(request_read_timeout_s=READ_TIMEOUT_S, keep_alive_timeout_s=60)) as address:
        assert await received_until_closed(address, b"") == b""
        received = await received_until_closed(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert received.startswith(b"HTTP/1.1 200 ") and received.count(b"HTTP/1.1") == 1


class EndlessAnswerGateway(Gateway):
    """A gateway whose every call streams a long answer, without a mesh."""

    async def models(self):
        from hearth.protocol.discovery import ModelsReply, ServedModel

        self._known_models = {"m"}
        return ModelsReply(models=[ServedModel(id="m", total_layers=2, complete=True)], default_model="m")

    def call(self, request, caller):
        return EndlessAnswer(request)


class EndlessAnswer(MeshCall):
    """A call whose answer is the longest a request allows (max_choices choices of max_tokens_limit tokens of
    max_text_bytes_per_token bytes each: 8 MiB), more than the socket buffers hold."""

    def __init__(self, request) -> None:
        from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame, Usage
        from hearth.services.client.answer_bound import max_text_bytes_per_token

        async def frames():
            tokens = request.max_tokens * request.n
            for seq in range(tokens):
                yield TokenDeltaFrame(seq=seq, text="x" * max_text_bytes_per_token, token_id=1, choice=seq % request.n)
            yield DoneFrame(seq=tokens, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=tokens))

        self.request, self.started, self._frames = request, 0.0, frames()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_stops_reading_its_answer_is_dropped_and_frees_its_call(stream):
    gateway = EndlessAnswerGateway(SimpleNamespace(is_connected=True),
                                   HearthSettings(gateway={"write_stall_timeout_s": READ_TIMEOUT_S}), keyring=None)
    dropped_before = write_stall_timeouts_total._value.get()
    async with serving(gateway) as address:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a window the answer fills at once
        client.connect(address)
        body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %d, "n": %d, '
                b'"stream": %s}' % (max_tokens_limit, max_choices, b"true" if stream else b"false"))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            deadline = asyncio.get_running_loop().time() + CLOSE_WAIT_S
            while ((gateway.open_calls or write_stall_timeouts_total._value.get() == dropped_before)
                   and asyncio.get_running_loop().time() < deadline):
                await asyncio.sleep(0.05)
            assert write_stall_timeouts_total._value.get() == dropped_before + 1, "the connection was not dropped"
            assert gateway.open_calls == 0, "the call still holds its slot"
        finally:
            client.close()


async def test_a_client_that_reads_slowly_but_steadily_is_not_dropped_until_it_stops_reading():
    # A large kernel buffer on the server's side: the kernel wakes a paused writer only once about half of it is
    # free, which this reader takes far longer than the stall timeout to free; it is reading all the while.
    gateway = EndlessAnswerGateway(SimpleNamespace(is_connected=True), HearthSettings(
        gateway={"write_stall_timeout_s": SLOW_READER_STALL_TIMEOUT_S}), keyring=None)
    servers: list = []
    dropped_before = write_stall_timeouts_total._value.get()
    async with serving(gateway, servers) as address:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(CLOSE_WAIT_S)
        client.connect(address)
        try:
            while not servers[0].server_state.connections:
                await asyncio.sleep(0.01)
            for connection in servers[0].server_state.connections:
                connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %d, "n": %d, '
                    b'"stream": true}' % (max_tokens_limit, max_choices))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            reads = []
            for _ in range(50):  # up to 512 bytes every 50 ms for 2.5 s: more than a stall timeout
                reads.append(len(await asyncio.to_thread(client.recv, 512)))
                await asyncio.sleep(0.05)
            assert write_stall_timeouts_total._value.get() == dropped_before, "a reading client was dropped"
            assert gateway.open_calls == 1 and all(reads), "the answer stopped coming"
            # Once it stops reading it is dropped as any stalled client is.
            deadline = asyncio.get_running_loop().time() + CLOSE_WAIT_S
            while gateway.open_calls and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert write_stall_timeouts_total._value.get() == dropped_before + 1 and gateway.open_calls == 0
        finally:
            client.close()


async def test_a_client_that_never_reads_the_answers_to_a_few_pipelined_requests_is_dropped():
    # Answers small enough that writing would not pause at the transport's default limit: uvicorn's keep-alive
    # timeout then closes the connection, and close() waits for the client to read them, for ever.
    gateway = gateway_with(write_stall_timeout_s=READ_TIMEOUT_S, keep_alive_timeout_s=READ_TIMEOUT_S,
                           request_read_timeout_s=READ_TIMEOUT_S)
    servers: list = []
    dropped_before = write_stall_timeouts_total._value.get()
    async with serving(gateway, servers) as address:
        connections = servers[0].server_state.connections
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        client.settimeout(CLOSE_WAIT_S)
        client.connect(address)
        try:
            deadline = asyncio.get_running_loop().time() + CLOSE_WAIT_S
            while not connections:
                assert asyncio.get_running_loop().time() < deadline, "the connection was never accepted"
                await asyncio.sleep(0.01)
            # A small kernel buffer on the server's side too, so that a few hundred answers fill it, not thousands.
            for connection in connections:
                connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            # Until an answer waits in the server's own buffer, the socket's being full.
            while not any(connection.transport.get_write_buffer_size() for connection in connections):
                assert asyncio.get_running_loop().time() < deadline, "no answer ever waited"
                await asyncio.to_thread(client.sendall, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
                await asyncio.sleep(0.02)
            while connections and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert not connections, "the connection lingers with its unread answers"
            assert write_stall_timeouts_total._value.get() == dropped_before + 1
        finally:
            client.close()


async def test_a_head_growing_past_the_limit_is_refused():
    """400, not 431: uvicorn answers every error of its h11 parser with 400 (h11's hint of 431 unread), and no
    setting of uvicorn changes that (docs/gateway.md, "Limits on clients")."""
    async with serving(gateway_with(max_header_bytes=1024)) as address:
        received = await received_until_closed(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: "
                                                        + b"a" * 4096)
        assert received.startswith(b"HTTP/1.1 400 ")


def test_one_member_has_at_most_its_open_calls_and_another_member_still_gets_in():
    gateway = gateway_with(max_open_requests_per_caller=2, retry_after_s=3)
    alice, bob = Caller("alice", None), Caller("bob", None)
    with gateway.open_call(alice), gateway.open_call(alice):
        with pytest.raises(GatewayError) as refused:
            with gateway.open_call(alice):
                pass
        # No call ended yet and the open ones just began: the fallback, [gateway] retry_after_s.
        assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (429, "overloaded", 3)
        assert waits_as_named(refused.value.response().headers, 3)
        with gateway.open_call(bob):
            assert gateway.open_calls == 3
    assert gateway.open_calls == 0 and not gateway.open_calls_by_member
    with gateway.open_call(alice):  # freed again
        pass


async def test_a_body_and_a_model_list_are_read_only_within_the_calls_share_and_messages_are_bounded():
    gateway = gateway_with(max_open_requests=1, keep_alive_timeout_s=READ_TIMEOUT_S,
                           request_read_timeout_s=READ_TIMEOUT_S)
    async with serving(gateway) as address:
        too_many = json.dumps({"model": "m", "messages": [{"role": "user"}] * (max_messages + 1)}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(too_many), too_many))
        answered = await received_until_closed(address, request + b"GET /x HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert answered.startswith(b"HTTP/1.1 400 ") and b'"param":"messages"' in answered.replace(b" ", b"")
        with gateway.open_call(None):  # every place taken: the body is not even read, nor the mesh asked
            answered = await received_until_closed(address, request)
            listed = await asyncio.to_thread(get, address, "/v1/models")
        assert answered.startswith(b"HTTP/1.1 429 ") and listed[0] == 429


async def test_no_cors_headers_unless_origins_are_configured():
    origin = {"Origin": "https://chat.example.org"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    async with serving(gateway_with()) as address:
        status, headers = await asyncio.to_thread(get, address, "/healthz", origin)
        assert status == 200 and "access-control-allow-origin" not in headers
        status, headers = await asyncio.to_thread(get, address, "/v1/chat/completions", preflight, "OPTIONS")
        assert status == 405 and "access-control-allow-origin" not in headers
    async with serving(gateway_with(cors_allowed_origins=["https://chat.example.org"])) as address:
        status, headers = await asyncio.to_thread(get, address, "/v1/chat/completions", preflight, "OPTIONS")
        assert status == 200 and headers["access-control-allow-origin"] == "https://chat.example.org"
        assert "authorization" in headers["access-control-allow-headers"].lower()
        other = {**preflight, "Origin": "https://evil.example.org"}
        status, headers = await asyncio.to_thread(get, address, "/v1/chat/completions", other, "OPTIONS")
        assert status == 400 and "access-control-allow-origin" not in headers


async def test_a_preflight_of_openai_s_browser_sdk_is_allowed():
    sdk_headers = ["authorization", "content-type", "openai-organization", "openai-project", "openai-beta",
                   "x-stainless-os", "x-stainless-lang", "x-stainless-package-version", "x-stainless-runtime",
                   "x-stainless-runtime-version", "x-stainless-arch", "x-stainless-retry-count",
                   "x-stainless-timeout", "x-stainless-helper-method"]
    preflight = {"Origin": "https://chat.example.org", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": ",".join(sdk_headers)}
    async with serving(gateway_with(cors_allowed_origins=["https://chat.example.org"])) as address:
        status, headers = await asyncio.to_thread(get, address, "/v1/chat/completions", preflight, "OPTIONS")
        assert status == 200 and headers["access-control-allow-origin"] == "https://chat.example.org"
        allowed = {name.strip() for name in headers["access-control-allow-headers"].lower().split(",")}
        assert set(sdk_headers) <= allowed
        # Named, not every header: one no client of ours sends is still refused.
        other = {**preflight, "Access-Control-Request-Headers": "x-something-else"}
        status, headers = await asyncio.to_thread(get, address, "/v1/chat/completions", other, "OPTIONS")
        assert status == 400 and "x-something-else" not in headers["access-control-allow-headers"].lower()


def test_the_api_port_serves_no_metrics():
    app = create_app(gateway_with())
    routes = {route.path for route in app.app.routes}
    assert "/metrics" not in routes and "/healthz" in routes


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b'"text"', b"", b'{"seq": 0}',
                                  b'{"type": "token_delta", "seq": 0}', b'{"type": "done", "seq": "x"}'])
def test_a_message_that_is_no_frame_is_skipped_uncounted(data):
    assert _decode_known(data) is None


@pytest.mark.parametrize("data, seq", [(b'{"type": "newer", "seq": 3}', 3), (b'{"type": "newer"}', -1),
                                       (b'{"type": "newer", "seq": true}', -1)])
def test_a_frame_of_an_unknown_type_is_skipped_but_its_number_counts(data, seq):
    assert _decode_known(data) == seq


async def test_asking_the_mesh_about_an_unseen_model_counts_as_an_open_call():
    class SlowCatalogGateway(Gateway):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.asked, self.release = asyncio.Event(), asyncio.Event()

        async def models(self):
            from hearth.protocol.discovery import ModelsReply

            self.asked.set()
            await self.release.wait()
            return ModelsReply(models=[], default_model=None)

    gateway = SlowCatalogGateway(SimpleNamespace(is_connected=True), HearthSettings(gateway={"max_open_requests": 1}),
                                 keyring=None)

    def ask(model: str) -> bytes:
        body = b'{"model": "%s", "prompt": "hi"}' % model.encode()
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    async with serving(gateway) as address:
        first = asyncio.create_task(received_until_closed(address, ask("unseen-1")))
        await asyncio.wait_for(gateway.asked.wait(), CLOSE_WAIT_S)
        second = await received_until_closed(address, ask("unseen-2"))
        assert second.startswith(b"HTTP/1.1 429 "), second[:80]
        gateway.release.set()
        assert (await first).startswith(b"HTTP/1.1 404 ")


def test_api_keys_asked_for_on_an_open_mesh_are_refused_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from hearth.services.cli import app

    result = CliRunner().invoke(app, ["gateway", "--insecure", "--community", str(tmp_path), "--port", "0"])
    assert result.exit_code == 1 and "which an open mesh (--insecure) does not use" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("answer", "status", "code"), [
    (b'{"type": "error", "seq": 0, "code": "bad_request", "message": "body: over max_request_bytes"}', 400,
     "bad_request"),
    (b'{"type": "error", "seq": 0, "code": "unauthorized", "message": "not a member"}', 403, "unauthorized"),
    (b"no models reply", 502, "internal_error"),
])
async def test_an_orchestrator_s_refusal_of_llm_models_is_an_openai_error_not_a_crash(answer, status, code):
    async def request(subject, data, timeout):
        return SimpleNamespace(data=answer)

    gateway = Gateway(SimpleNamespace(is_connected=True, request=request), HearthSettings(), keyring=None)
    with pytest.raises(GatewayError) as refused:
        await gateway.models()
    assert (refused.value.status, refused.value.code) == (status, code)


def test_paths_and_methods_the_gateway_does_not_serve_get_openai_shaped_errors_and_no_redirects():
    from starlette.testclient import TestClient

    client = TestClient(create_app(gateway_with()))
    for method, path, status, code in (("GET", "/v1/nope", 404, "not_found"), ("GET", "/v1/models/", 404, "not_found"),
                                       ("GET", "/v1/chat/completions", 405, "method_not_allowed")):
        answered = client.request(method, path, follow_redirects=False)
        assert (answered.status_code, answered.json()["error"]["code"]) == (status, code)
    assert client.get("/v1/chat/completions").headers["allow"] == "POST"
