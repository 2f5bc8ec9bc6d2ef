"""How hearth-replay reaches the broker: one connection, quick to say when the broker is not there, riding out a
restart of it once connected, and a request refused to this member said as such (not as a timeout)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hearth.services.common.config import NatsSettings

# A reader says soon that the broker is away.
replay_connect_timeout_s = 5.0


async def _connect(broker: "NatsSettings"):
    from hearth.services.broker.connection import connect_nats

    # The invocation's [nats] settings: its member key (an auditor's, on a community mesh) and the broker's URL. A
    # reader says soon when the broker is away, and, once connected, rides out a restart of it as every hearth
    # process does (--follow).
    nats_settings = broker.model_copy(update={"connect_timeout_s": replay_connect_timeout_s})
    return await connect_nats(broker.url, name="hearth-replay", settings=nats_settings, wait_for_broker=False)


class MemberRefused(Exception):
    """The broker refused this member a request (its role may not read the streams): said instead of a timeout."""


@contextlib.asynccontextmanager
async def jetstream(broker: "NatsSettings"):
    """A JetStream context on a connection of its own to the broker `broker` names, closed on the way out."""
    import nats.errors

    nc = await _connect(broker)
    try:
        yield nc.jetstream()
    except nats.errors.TimeoutError:  # a refused request is never answered: the refusal came as an error of its own
        if "permissions violation" in str(nc.last_error).lower():
            raise MemberRefused(f"the broker refused this member a request ({nc.last_error}); reading the event log "
                                "takes a member that may (an auditor's key)") from None
        raise
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
