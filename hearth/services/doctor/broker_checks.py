"""The checks of `hearth doctor` that need the broker, each wait bounded: a login as the member (reached, and its key
admitted), the event streams its role waits for, its clock against the broker's (a caller's against the orchestrator
that answers it), a `store:NAME` model's manifest, and for a caller whether an orchestrator answers. When the broker
cannot be reached, each says it was skipped."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from hearth.events.broker_clock import broker_clock_offset_s
from hearth.events.clock_skew import skew_in_words
from hearth.events.streams import SHARDS_STREAM, StreamsUnknown, missing_streams, streams_missing
from hearth.services.broker.connection import (
    BrokerRefusedCredentials,
    BrokerUnreachable,
    broker_refusal,
    close_quietly,
    connect_nats,
)
from hearth.services.common.config import HearthSettings
from hearth.services.common.lifecycle import CommandRefused
from hearth.services.common.nats_urls import url_without_password
from hearth.services.doctor.report import CheckResult, fail, ok, skip, warn
from hearth.services.doctor.roles import CALLER_DOCTOR_ROLES, STREAMS_READ, DoctorRole

# The longest the login may take (the configured [nats] connect_timeout_s when shorter), each request after it, and
# the whole of these checks: a household waits seconds for its answer, not a long-running command's patience.
doctor_connect_s = 5.0
doctor_request_s = 3.0
doctor_broker_checks_s = 30.0
# A refused login is tried again this long at most (a broker reloading its configuration refuses briefly).
doctor_refused_grace_s = 1.0
# A clock this share of [events] max_clock_skew_s off is warned of: a little more drift and the member is refused.
clock_warn_share = 0.5
CONNECT_FIX = ("start the broker (on its machine: hearth nats --host 0.0.0.0 --community DIR), or give its URL with "
               "--nats (or [nats] url); a firewall between must let its port through")
TLS_FIX = ("set [nats] tls_ca_file to the CA that signed the broker's certificate (the community's tls/ca.pem), and "
           "reach the broker by a host name its certificate holds (`hearth community tls --host HUB`)")
REFUSED_FIX = ("the broker does not admit this key yet: a broker run by `hearth nats --community DIR` takes the "
               "steward's roster within seconds (is this member in it?); for another nats-server the steward renders "
               "`hearth community nats-config` into its configuration and reloads it")
CLOCK_FIX = ("set this machine's clock by NTP (timedatectl set-ntp true); when every member finds the same, the "
             "broker's machine is the one off")
BROKER_CHECKS = ("streams", "clock", "orchestrators")


@dataclass(frozen=True)
class BrokerFindings:
    """What the broker's checks said, and a `store:NAME` model's manifest when one was read (for the memory check)."""

    checks: list[CheckResult]
    manifest: object | None = None


def shown_url(url: str) -> str:
    """The broker URL (a cluster's, comma-separated) as a line may show it: no password."""
    return ",".join(url_without_password(part) for part in url.split(","))


def skipped_broker_checks(role: DoctorRole, why: str, store_model: str | None = None) -> list[CheckResult]:
    """A skip line for each broker check `role` has, saying `why`."""
    names = [name for name in BROKER_CHECKS if _has_check(role, name)]
    if store_model is not None:
        names.append("model")
    return [skip(name, why) for name in names]


def _has_check(role: DoctorRole, name: str) -> bool:
    return {"streams": bool(STREAMS_READ[role]), "clock": True, "orchestrators": role in CALLER_DOCTOR_ROLES}[name]


async def broker_checks(settings: HearthSettings, role: DoctorRole, member: str | None, store_model: str | None,
                        *, fits_role: bool) -> BrokerFindings:
    """Log in to the broker `settings.nats` names as the member its key is, then run `role`'s checks there (unless
    the member does not `fits_role`: the broker would refuse what they ask)."""
    nats = settings.nats.model_copy(update={
        "connect_timeout_s": min(settings.nats.connect_timeout_s, doctor_connect_s), "wait_for_broker": False,
        "refused_grace_s": min(settings.nats.refused_grace_s, doctor_refused_grace_s)})
    url = shown_url(nats.url)
    try:
        nc = await connect_nats(nats.url, name="hearth-doctor", settings=nats, wait_for_broker=False)
    except BrokerRefusedCredentials:
        refused = fail("broker", f"{url} refused this member's key (authorization violation)", REFUSED_FIX)
        return BrokerFindings([refused, *skipped_broker_checks(role, "the broker refused the login", store_model)])
    except BrokerUnreachable as error:
        said = str(error).replace(nats.url, url)
        return BrokerFindings([fail("broker", said, TLS_FIX if error.tls_failure is not None else CONNECT_FIX),
                               *skipped_broker_checks(role, "the broker is unreachable", store_model)])
    except (CommandRefused, ValueError, OSError) as error:  # what nats-py or the files it reads refused at once
        return BrokerFindings([fail("broker", f"cannot log in to {url}: {str(error).replace(nats.url, url)}"),
                               *skipped_broker_checks(role, "no login", store_model)])
    try:
        if not fits_role:
            return BrokerFindings([_reached(nc, url, member),
                                   *skipped_broker_checks(role, f"the member is no {role} (above)", store_model)])
        async with asyncio.timeout(doctor_broker_checks_s):
            return await _logged_in_checks(nc, settings, role, member, store_model, url)
    finally:
        await close_quietly(nc, nats.close_timeout_s)


async def _logged_in_checks(nc, settings: HearthSettings, role: DoctorRole, member: str | None,
                            store_model: str | None, url: str) -> BrokerFindings:
    checks = [_reached(nc, url, member)]
    open_broker = settings.nats.creds_file is None
    streams = STREAMS_READ[role]
    if streams:
        checks.append(await streams_check(nc, streams, url))
    orchestrators = await ask_orchestrators(nc) if role in CALLER_DOCTOR_ROLES else None
    # A member whose role reads no stream (a caller) may ask the broker nothing that carries its time, but an
    # orchestrator's answer does, the clock its calls are checked against; on an open broker anyone may read any
    # stream.
    clock_stream = streams[0] if streams else (SHARDS_STREAM if open_broker else None)
    checks.append(await clock_check(nc, clock_stream, settings.events.max_clock_skew_s,
                                    orchestrator_offset_s=None if orchestrators is None else orchestrators.offset_s))
    manifest = None
    if store_model is not None:
        found, manifest = await store_model_check(nc, store_model)
        checks.append(found)
    if orchestrators is not None:
        checks.append(orchestrators.check)
    return BrokerFindings(checks, manifest)


def _reached(nc, url: str, member: str | None) -> CheckResult:
    version = nc.connected_server_version
    return ok("broker", f"reached {url} as {member or 'an open broker user'} (nats-server {version.major}."
                        f"{version.minor}.{version.patch})")


async def streams_check(nc, streams: tuple[str, ...], url: str) -> CheckResult:
    """Whether the broker holds the event streams a process of this role waits for at start."""
    try:
        missing = await missing_streams(nc.jetstream(), streams)
    except StreamsUnknown as error:
        refusal = broker_refusal(nc)
        said = f"{error} (the broker refused: {refusal})" if refusal else str(error)
        stale = f"the broker's permissions for this member are older than the roster: {REFUSED_FIX}"
        return fail("streams", said, stale if refusal else None)
    if missing:
        return fail("streams", str(streams_missing(missing, url)))
    return ok("streams", f"{', '.join(streams)} exist")


async def clock_check(nc, stream: str | None, max_clock_skew_s: float, *,
                      orchestrator_offset_s: float | None = None) -> CheckResult:
    """This machine's clock against the broker's (its time in `stream`'s info), judged by [events] max_clock_skew_s;
    where the member may read no stream (a caller), against the orchestrator's that answered it
    (`orchestrator_offset_s`: this clock less that one, ask_orchestrators), else skipped."""
    if stream is None:
        if orchestrator_offset_s is not None:
            return _clock_verdict(orchestrator_offset_s, max_clock_skew_s, "an orchestrator's", "calls")
        return skip("clock", "a caller may read no broker time (no stream, no $SYS subject) and no orchestrator "
                             "answered with its own: its calls are checked against an orchestrator's clock, within "
                             f"{max_clock_skew_s:g} s ([events] max_clock_skew_s); keep this machine's clock set by "
                             "NTP")
    try:
        offset_s = await broker_clock_offset_s(nc, stream, timeout_s=doctor_request_s)
    except (NatsTimeoutError, asyncio.TimeoutError, NoRespondersError):
        return warn("clock", f"the broker did not answer for its time within {doctor_request_s:g} s")
    if offset_s is None or not math.isfinite(offset_s):
        return warn("clock", f"the broker did not say its time in {stream}'s info (a nats-server before 2.10, or no "
                             "such stream)")
    return _clock_verdict(offset_s, max_clock_skew_s, "the broker's", "events, calls or opens")


def _clock_verdict(offset_s: float, max_clock_skew_s: float, whose: str, refused: str) -> CheckResult:
    """`offset_s` (this clock less `whose` clock) judged by [events] max_clock_skew_s: beyond it this machine's
    `refused` are refused."""
    skew = skew_in_words(offset_s, f"{whose} clock")
    said = f"{skew} (at most {max_clock_skew_s:g} s allowed: [events] max_clock_skew_s)"
    if abs(offset_s) > max_clock_skew_s:
        return fail("clock", f"this machine's clock is {said}: its {refused} are refused", CLOCK_FIX)
    if abs(offset_s) > clock_warn_share * max_clock_skew_s:
        return warn("clock", f"this machine's clock is {said}", CLOCK_FIX)
    return ok("clock", f"within {abs(offset_s):.1f} s of {whose} (at most {max_clock_skew_s:g} s allowed)")


async def store_model_check(nc, name: str) -> tuple[CheckResult, object | None]:
    """The manifest of `store:NAME` in the community's weights store, as a shard host reads it before planning."""
    from hearth.services.weights_store import WeightsStoreError, read_manifest, refusals_told

    try:
        async with asyncio.timeout(doctor_request_s * 2):
            manifest = await refusals_told(nc, read_manifest(nc.jetstream(), name))
    except WeightsStoreError as error:
        return fail("model", str(error), "the steward publishes it: hearth weights publish"), None
    except (asyncio.TimeoutError, NatsTimeoutError) as error:
        return fail("model", f"the manifest of store:{name} did not come within {doctor_request_s * 2:g} s "
                             f"({type(error).__name__})"), None
    return ok("model", f"store:{name}: {manifest.num_layers} layers in the community's store"), manifest


@dataclass(frozen=True)
class OrchestratorsAnswer:
    """What asking `llm.models` found: the orchestrators check, and this clock less the answering orchestrator's
    (None: no answer, or one from an orchestrator that does not say its time)."""

    check: CheckResult
    offset_s: float | None = None


async def ask_orchestrators(nc) -> OrchestratorsAnswer:
    """Whether an orchestrator answers `llm.models`, and what it serves (as `hearth models` asks), with its clock."""
    from hearth.protocol.subjects import MODELS_REQUEST_SUBJECT
    from hearth.services.client.chat import ModelsRefused, list_models

    try:
        before = time.time()
        reply = await list_models(nc, doctor_request_s)
        after = time.time()
    except NoRespondersError:
        return OrchestratorsAnswer(warn("orchestrators", f"none is listening on {MODELS_REQUEST_SUBJECT}: calls are "
                                                         "refused until one runs",
                                        "start one: hearth orchestrator --creds KEY"))
    except (NatsTimeoutError, asyncio.TimeoutError):
        return OrchestratorsAnswer(warn("orchestrators",
                                        f"none answered {MODELS_REQUEST_SUBJECT} within {doctor_request_s:g} s"))
    except ModelsRefused as refused:
        return OrchestratorsAnswer(warn("orchestrators", f"the orchestrator refused: {refused}"))
    served = ", ".join(model.id for model in reply.models) or "none yet"
    offset_s = None if reply.orchestrator_time_s is None else (before + after) / 2 - reply.orchestrator_time_s
    return OrchestratorsAnswer(ok("orchestrators", f"an orchestrator answers; models served: {served}"), offset_s)
