"""Test helpers for a community's event log on a real broker: the broker with the community's streams, reading the
log as the auditor `eve` and applying it to a read model as a live projector does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from sqlalchemy.orm import Session

from hearth.events.consume import read_stream
from hearth.events.streams import ALL_STREAMS
from hearth.readmodels.db import open_engine
from hearth.readmodels.projection import ReadModelProjection
from hearth.services.broker.connection import connect_nats
from hearth.services.broker.permissions import render_authorization
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.broker.streams import create_community_streams
from hearth.services.common.config import NatsSettings
from hearth.trust.community import Community


@contextlib.contextmanager
def community_on_a_broker(folder: Path, members: Iterable[tuple[str, str]]
                          ) -> Iterator[tuple[Community, EmbeddedNatsServer]]:
    """A community `elm-street` in `folder`/community with `members` (name, role) and its steward, on a broker of its
    own (store in `folder`/nats) that admits them, with the event streams the steward created."""
    community = Community.init(folder / "community", "elm-street")
    for name, role in members:
        community.add(name, role)  # type: ignore[arg-type]
    with EmbeddedNatsServer(store_dir=folder / "nats", authorization=render_authorization(community.roster())) \
            as server:
        asyncio.run(create_community_streams(NatsSettings(url=server.url), community.system_key_path,
                                             ready_timeout_s=10))
        yield community, server


async def as_auditor(community: Community, url: str, work):
    """`work(js)` over a connection as the community's auditor `eve`."""
    return await _as_member(url, community.directory / "keys" / "eve.nk", "test-auditor", work)


async def as_steward(community: Community, url: str, work):
    """`work(js)` over a connection as the community's steward (its system key)."""
    return await _as_member(url, community.system_key_path, "test-steward", work)


async def _as_member(url: str, creds_file: Path, name: str, work):
    connection = await connect_nats(url, name=name, settings=NatsSettings(url=url, creds_file=creds_file))
    try:
        return await work(connection.jetstream())
    finally:
        await connection.close()


def apply_new_messages(community, url, path, verifier) -> None:
    """What a live projector does: apply every message beyond its stored positions."""

    async def work(js):
        messages = []
        for stream in ALL_STREAMS:
            async with contextlib.aclosing(read_stream(js, stream)) as items:
                messages += [item async for item in items]
        return messages

    messages = asyncio.run(as_auditor(community, url, work))
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        ReadModelProjection(verifier=verifier).apply_many(session, messages)
    engine.dispose()
