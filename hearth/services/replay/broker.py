"""How hearth-replay reaches the broker: one connection, quick to say when the broker is not there, riding out a
restart of it once connected, and a request refused to this member said as such (not as a timeout)."""

from __future__ import annotations

import contextlib

# A reader says soon that the broker is away.
replay_connect_timeout_s = 5.0


async def _connect(url: str):
    from hearth.services.broker.connection import connect_nats
    from hearth.services.common.config import load_settings

    # The member key from $HEARTH_NATS__CREDS_FILE (an auditor's, on a community mesh). A reader says soon when the
    # broker is away, and, once connected, rides out a restart of it as every hearth process does (--follow).
    nats_settings = load_settings(None).nats.model_copy(update={"connect_timeout_s": replay_connect_timeout_s})
    return await connect_nats(url, name="hearth-replay", settings=nats_settings, wait_for_broker=False)


class MemberRefused(Exception):
    """The broker refused this member a request (its role may not read the streams): said instead of a timeout."""


@contextlib.asynccontextmanager
async def jetstream(url: str):
    """A JetStream context on a connection of its own to `url`, closed on the way out."""
    import nats.errors

    nc = await _connect(url)
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
