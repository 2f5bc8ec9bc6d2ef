"""What a call's outbox sends again (hearth/services/orchestrator/client_stream.py), over a stand-in connection: after
"no responders" on a frame, or a reconnect of its own, every kept frame once the client listens again, in order,
before the next new one; nothing again for a keepalive unheard after the final frame; no more than its share of
replays for a client that keeps leaving; and a client silent past the grace is gone."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hearth.protocol.chat_frames import DoneFrame, TokenDeltaFrame, Usage
from hearth.services.broker.connection import NO_RESPONDERS_STATUS
from hearth.services.orchestrator import client_stream
from hearth.services.orchestrator.client_stream import ClientStream

CLIENT_INBOX = "_INBOX.caller.1"
STATUS_INBOX = "_INBOX.orchestrator.status"


class StandInConnection:
    """Publishes into a list; the client's inbox is listened to unless `client_away`, and then every publish to it
    is answered "no responders", as nats-server does."""

    def __init__(self) -> None:
        self.stats = {"reconnects": 0}
        self.is_closed = False
        self.is_connected = True
        self.pending_data_size = 0
        self.client_away = False
        self.received: list[dict] = []  # what reached the client
        self._status_callback = None

    def new_inbox(self) -> str:
        return STATUS_INBOX

    async def subscribe(self, subject: str, cb):
        assert subject == f"{STATUS_INBOX}.*"
        self._status_callback = cb
        return SimpleNamespace(unsubscribe=self._unsubscribed)

    async def _unsubscribed(self) -> None:
        self._status_callback = None

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        assert subject == CLIENT_INBOX and reply.startswith(f"{STATUS_INBOX}.")
        if not self.client_away:
            self.received.append(json.loads(data))
        elif self._status_callback is not None:
            await self._status_callback(SimpleNamespace(subject=reply, headers={"Status": NO_RESPONDERS_STATUS}))

    async def flush(self, timeout: float) -> None:
        return None


async def outbox(connection: StandInConnection, grace_s: float = 60.0) -> ClientStream:
    return await ClientStream(connection, CLIENT_INBOX, resubscribe_grace_s=grace_s, missing_grace_s=grace_s,
                              probe_timeout_s=1.0).start()


def token(index: int) -> TokenDeltaFrame:
    return TokenDeltaFrame(seq=0, text=f" t{index}", token_id=index)


def numbered(received: list[dict]) -> list[int]:
    return [frame["seq"] for frame in received if frame["type"] != "keepalive"]


async def test_frames_unheard_while_the_client_was_away_are_sent_again_before_the_next_one():
    connection = StandInConnection()
    stream = await outbox(connection)
    for index in range(3):
        await stream.send(token(index))
    connection.client_away = True
    await stream.send(token(3))  # "no responders"
    await stream.send(token(4))  # still away: the probe finds nobody, the frame is unheard too
    connection.client_away = False
    await stream.send(token(5))
    assert numbered(connection.received) == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert (stream.frames_sent_again, stream.replays, stream.client_gone.is_set()) == (5, 1, False)


async def test_a_reconnect_of_ours_sends_the_kept_frames_again_once():
    connection = StandInConnection()
    stream = await outbox(connection)
    await stream.send(token(0))
    await stream.send(token(1))
    connection.stats["reconnects"] += 1  # what we wrote just before may have gone with the connection
    await stream.send(token(2))
    await stream.send(token(3))
    assert numbered(connection.received) == [0, 1, 0, 1, 2, 3]


async def test_a_keepalive_unheard_after_the_final_frame_sends_nothing_again():
    connection = StandInConnection()
    stream = await outbox(connection)
    await stream.send(token(0))
    await stream.send(DoneFrame(seq=0, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)))
    connection.client_away = True  # it read `done` and left
    await stream.keep_alive(0.0)
    await stream.settle()
    assert numbered(connection.received) == [0, 1] and stream.replays == 0


async def test_the_final_frame_unheard_is_sent_again_when_the_call_settles():
    connection = StandInConnection()
    stream = await outbox(connection)
    await stream.send(token(0))
    connection.client_away = True
    await stream.send(DoneFrame(seq=0, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)))
    connection.client_away = False
    await stream.settle()
    assert numbered(connection.received) == [0, 0, 1]


async def test_a_client_that_keeps_leaving_gets_its_share_of_replays_and_no_more(monkeypatch):
    monkeypatch.setattr(client_stream, "replays_per_call", 2)
    connection = StandInConnection()
    stream = await outbox(connection)
    for index in range(4):
        connection.client_away = True
        await stream.send(token(index))
        connection.client_away = False
        await stream.keep_alive(60.0)  # the replay is due: it goes out at the keepalive's turn
    assert numbered(connection.received) == [0, 0, 1]
    assert stream.replays == 2


async def test_a_client_unheard_past_the_grace_is_gone():
    connection = StandInConnection()
    stream = await outbox(connection, grace_s=0.0)
    await stream.send(token(0))
    connection.client_away = True
    await stream.send(token(1))
    assert stream.client_gone.is_set()
