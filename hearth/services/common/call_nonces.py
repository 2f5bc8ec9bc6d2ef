"""The mesh-wide record of signed calls' nonces: a JetStream key-value bucket where an orchestrator creates one key
per call it admits (`<signer>.<nonce>`), create-only (a create of an existing key fails), so a captured call that a
member re-publishes to the queue group is refused by whichever orchestrator gets it, not only by the one that saw it
first (CallVerifier's own nonce cache: hearth/services/common/call_signing.py).

Each record lives, as a per-message TTL within the bucket's own max age, for the orchestrator's nonce window (twice
[events] max_clock_skew_s, as its own cache: past it the call's timestamp is refused as stale anyway) and one more
max_clock_skew_s: the orchestrator that gets a replay may run that far behind the one that recorded the call, and
would take the call's timestamp as fresh for that much longer.
The steward creates the bucket with the event streams (hearth/services/broker/streams.py); only orchestrators may
write it (hearth/services/broker/permissions.py). It refuses rollups and purges: no member can take a record back,
and a delete marker still counts as a record (a create expects no message at all on the key).

When the broker does not record the nonce within call_nonce_timeout_s (reconnecting, JetStream electing a leader for
the bucket while a household link is cut, the bucket full), the call is admitted all the same, counted
(`hearth_call_nonces_unrecorded_total`) and logged, and its nonce is recorded in the background until the broker
takes it (or its window passes): the calls' answers travel on core NATS, which such an outage leaves working, and
refusing every call for the seconds an election takes would turn a household's cut link into a mesh-wide outage.
What that leaves open: a replay to another orchestrator inside the outage itself, which costs the caller a share of
its quota, never its answer (the signature binds the reply inbox); this orchestrator's own nonce cache still refuses
a replay to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, Header, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError

from hearth.events.cancellation import keeping_cancellation
from hearth.events.streams import MiB, StreamSetup, cluster_stream_replicas, ensure_stream, wait_for_streams
from hearth.services.common.call_signing import HEADER_CALLER, HEADER_CALLER_NONCE, CallRefused, CallVerifier
from hearth.services.common.metrics import counter
from hearth.trust.roster import Member

log = logging.getLogger(__name__)

CALL_NONCES_BUCKET = "hearth-call-nonces"
CALL_NONCES_STREAM = f"KV_{CALL_NONCES_BUCKET}"
CALL_NONCES_SUBJECTS = f"$KV.{CALL_NONCES_BUCKET}.>"
# The longest any record is kept, whatever window an orchestrator asks for (by default it asks 90 s).
call_nonces_max_age_s = 3600.0
# The bucket's size on disk: about a million records. When full it refuses new ones rather than forgetting records
# before their time, which would let replays through (the calls are admitted all the same, as in an outage: above).
call_nonces_max_bytes = 256 * MiB
# A record's value: the name of the orchestrator that admitted the call (for whoever reads the bucket). The broker
# counts a message's headers (the expected sequence, the TTL) in its size too: the stream's limit leaves them room.
call_nonce_value_max_bytes = 128
call_nonce_message_max_bytes = 1024
# How long an orchestrator waits for the broker to record a nonce before it refuses the call.
call_nonce_timeout_s = 2.0
# A nonce the broker did not record in time is tried again this often, in the background, until its window passes;
# at most this many such nonces are held at once (past them, one more is only counted and logged).
call_nonce_rerecord_every_s = 1.0
max_nonces_recorded_later = 1024
# JetStream's "wrong last sequence" errors: the key has a record already.
_KEY_EXISTS_ERR_CODES = (10071, 10164)

nonces_unrecorded_total = counter(
    "hearth_call_nonces_unrecorded_total",
    "Signed calls admitted while the broker did not record their nonce mesh-wide in time (recorded later, in the "
    "background); `found_recorded`: the later record found one already (the first try's, its answer lost, or "
    "another orchestrator's: a replay)",
    ["outcome"])
for _outcome in ("admitted", "found_recorded", "never_recorded"):
    nonces_unrecorded_total.labels(_outcome)  # read 0, not nothing, before any


def call_nonces_config(*, replicas: int = cluster_stream_replicas) -> StreamConfig:
    """The bucket's stream as the steward creates it (the layout of a NATS key-value bucket, one value per key)."""
    return StreamConfig(
        name=CALL_NONCES_STREAM, description="hearth: nonces of the signed calls orchestrators admitted",
        subjects=[CALL_NONCES_SUBJECTS], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
        discard=DiscardPolicy.NEW, max_age=call_nonces_max_age_s, max_bytes=call_nonces_max_bytes,
        max_msg_size=call_nonce_message_max_bytes, max_msgs_per_subject=1, num_replicas=replicas,
        allow_msg_ttl=True, allow_rollup_hdrs=False, deny_delete=True, deny_purge=True, allow_direct=True)


async def ensure_call_nonces(js: JetStreamContext, *, replicas: int = cluster_stream_replicas) -> None:
    """Create the bucket, or bring an existing one to the current spec (the steward's, or any process's on an open
    broker)."""
    await ensure_stream(js, call_nonces_config, replicas=replicas)


class NonceUnrecorded(RuntimeError):
    """The broker did not record a call's nonce, nor say it had one: whether the call is a replay is unknown."""


class MeshNonces:
    """One orchestrator's side of the record: `first_on_mesh` creates a call's key, and says whether it was new."""

    def __init__(self, js: JetStreamContext, *, window_s: float, recorded_by: str,
                 timeout_s: float = call_nonce_timeout_s) -> None:
        # The broker counts a TTL in whole seconds; never below one, never past what the bucket keeps.
        self.window_s = max(1, min(math.ceil(window_s), int(call_nonces_max_age_s)))
        if window_s > call_nonces_max_age_s:
            log.warning("the nonce window (%g s, three times [events] max_clock_skew_s) is longer than the mesh-wide "
                        "record keeps nonces (%g s): a call replayed to another orchestrator later than that is "
                        "not refused", window_s, call_nonces_max_age_s)
        self._js = js
        self._value = recorded_by.encode()[:call_nonce_value_max_bytes]
        self.timeout_s = timeout_s
        self._recording_later: set[asyncio.Task] = set()

    @classmethod
    def for_calls_of(cls, verifier: CallVerifier, js: JetStreamContext, *, recorded_by: str) -> "MeshNonces":
        """The record for the calls `verifier` checks: kept for its nonce window and one clock skew more."""
        return cls(js, window_s=verifier.nonce_window_s + verifier.max_clock_skew_s, recorded_by=recorded_by)

    async def ready(self, setup: StreamSetup) -> None:
        """Make sure the bucket exists as the event streams are made sure of: created here on an open broker, the
        steward's waited for on a community one."""
        if setup.create:
            await ensure_call_nonces(self._js)
        else:
            await wait_for_streams(self._js, (CALL_NONCES_STREAM,), wait_s=setup.wait_s)

    async def admitted(self, member: Member, headers: Mapping[str, str]) -> Member | CallRefused:
        """`member`'s call, checked by CallVerifier, once its nonce is recorded; refused when an orchestrator of the
        mesh had it already (`replayed`); admitted when the broker did not record it in time, and recorded later."""
        signer, nonce = headers[HEADER_CALLER], headers[HEADER_CALLER_NONCE]
        try:
            first = await self.first_on_mesh(signer, nonce)
        except NonceUnrecorded as error:
            nonces_unrecorded_total.labels("admitted").inc()
            log.warning("a call of %s admitted without its nonce recorded mesh-wide (%s); recording it in the "
                        "background", member.name, error)
            self._record_later(member.name, signer, nonce)
            return member
        if not first:
            return CallRefused("replayed", "this call was already received by an orchestrator of this mesh "
                                           "(same nonce)")
        return member

    async def first_on_mesh(self, signer: str, nonce: str) -> bool:
        """Record `signer`'s `nonce`: True when no orchestrator of the mesh had, False when one had (a replay);
        NonceUnrecorded when the broker did not say within timeout_s. `signer` and `nonce` are of their checked
        forms (call_signing.malformed_signing_header), so the key is one valid subject token each."""
        subject = f"$KV.{CALL_NONCES_BUCKET}.{signer}.{nonce}"
        try:
            async with asyncio.timeout(self.timeout_s):
                await keeping_cancellation(self._js.publish(
                    subject, self._value, timeout=self.timeout_s, msg_ttl=self.window_s,
                    headers={Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "0"}))
        except APIError as error:
            if error.err_code in _KEY_EXISTS_ERR_CODES:
                return False
            raise NonceUnrecorded(f"the broker refused the record: {error.description or error}") from None
        except (NatsError, TimeoutError) as error:
            raise NonceUnrecorded(str(error) or f"no answer within {self.timeout_s:g} s") from None
        return True

    def _record_later(self, caller: str, signer: str, nonce: str) -> None:
        if len(self._recording_later) >= max_nonces_recorded_later:
            nonces_unrecorded_total.labels("never_recorded").inc()
            log.warning("a nonce of %s is not recorded mesh-wide: %d others wait for the broker already", caller,
                        len(self._recording_later))
            return
        task = asyncio.ensure_future(self._keep_recording(caller, signer, nonce))
        self._recording_later.add(task)
        task.add_done_callback(self._recording_later.discard)

    async def _keep_recording(self, caller: str, signer: str, nonce: str) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.window_s
        while loop.time() < until:
            await asyncio.sleep(call_nonce_rerecord_every_s)
            try:
                first = await self.first_on_mesh(signer, nonce)
            except NonceUnrecorded:
                continue
            if not first:
                nonces_unrecorded_total.labels("found_recorded").inc()
                log.warning("the nonce of a call of %s admitted while the broker was away was recorded already: by "
                            "the first try, whose answer was lost, or by another orchestrator that took it too", caller)
            return
        nonces_unrecorded_total.labels("never_recorded").inc()

    async def close(self) -> None:
        """Stop recording nonces in the background (their calls are served; what is left unrecorded stays so)."""
        for task in list(self._recording_later):
            task.cancel()
        await asyncio.gather(*self._recording_later, return_exceptions=True)
