"""The steward keys the event streams' logs name, and the member keys they retired, for a process with no read model
that checks signed calls or opens (an orchestrator's calls, a shard host's opens): it reads each stream's removals
subject from its first message and follows it, judging each removal and rotation as a projection does
(hearth/events/logged_keys.py), so the steward's rotation of its own key retires the old key for calls and opens, and
names the new one, a member's key rotation retires its key for them and names its new one (member_keys), and a
member's removal retires its key, and a member's addition makes its key that member's (member_additions), with no new
roster copy.
What it learns it keeps in a file in the process's state folder, read first at its next start
(hearth/services/common/kept_steward_keys.py): a removal or rotation that has aged out of the streams still counts.
Calls, opens and steps ask it through views (hearth/services/common/logged_key_views.py), built again only when a new
change is read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hearth.events.consume import StoredEvent, read_stream
from hearth.events.logged_keys import LoggedKeys
from hearth.events.member_additions import LoggedAddition
from hearth.events.models import MemberChange, MemberRemoved
from hearth.events.signing import EventVerifier
from hearth.events.streams import MEMBER_REMOVAL_SUBJECTS
from hearth.services.common.kept_steward_keys import (
    KeptRemoval,
    counts_on_its_stream,
    load_kept_removals,
    write_kept_removals,
)
from hearth.services.common.logged_key_views import LoggedKeyViews

log = logging.getLogger(__name__)

# How long a process's start waits for the logs' steward keys before it serves with what it has (the roster alone,
# for a stream not read yet): the removals subjects hold one message per removal, read in a moment.
steward_keys_catch_up_s = 10.0
# How long a read that failed (a broker away, a stream not there yet) waits before it is tried again, at most.
retry_initial_s, retry_max_s = 0.5, 10.0


class StewardKeysFromTheLog:
    """Reads and follows the removals subject of each of `streams` (those a member of this role may read), from its
    first message: named() is what CallVerifier's `logged_steward_keys` asks. With `kept_file`, the removals and
    rotations it learns are kept there, and those kept before count from its start (None: it keeps nothing)."""

    def __init__(self, js: Any, verifier: EventVerifier, streams: Sequence[str],
                 kept_file: Path | None = None) -> None:
        self._js = js
        self._verifier = verifier
        self.streams = [stream for stream in streams if stream in MEMBER_REMOVAL_SUBJECTS]
        self._logged = LoggedKeys()
        self.kept_file = kept_file
        # Read apart from the streams' own: each stream's rotations are judged at their place in its log.
        self._kept_keys = LoggedKeys()
        self._views: LoggedKeyViews | None = None  # what both teach, built when asked (views())
        self._kept: dict[tuple[str, int], KeptRemoval] = {}
        self._kept_written = True  # False while a removal learned is not in the file yet
        self._writing = asyncio.Lock()  # one write at a time, so a later one never lands under an earlier one
        self._caught_up = {stream: asyncio.Event() for stream in self.streams}
        # Told each verified removal or rotation whose key no stream read so far had retired, as it is read (on the
        # event loop; each must return at once): a shard host drops what that key's opens left there.
        self.retirement_listeners: list[Callable[[MemberRemoved], None]] = []
        self._tasks: list[asyncio.Task] = []

    def views(self) -> LoggedKeyViews:
        """What the logs and the kept file retired and named so far, indexed by key and member: the same object until
        a new removal, rotation or addition is read."""
        if self._views is None:
            self._views = LoggedKeyViews.of(self._kept_keys, self._logged)
        return self._views

    def named(self) -> list[tuple[str, str]]:
        """Each steward key the logs named so far, or the kept file did, with the one it succeeded (every stream's)."""
        return list(self.views().steward_keys)

    def member_keys(self) -> list[tuple[str, str, str]]:
        """Each member key (not the steward's) the logs or the kept file named so far: (it, the key it succeeded, the
        member), every stream's (a check of one key or member asks views())."""
        return list(self.views().member_keys)

    def member_additions(self) -> list[tuple[str, LoggedAddition]]:
        """Each member the logs or the kept file added so far, with its key, every stream's (a check of one key or
        member asks views())."""
        return list(self.views().additions)

    def retired_keys(self) -> frozenset[str]:
        """Every key a verified removal or rotation on any stream read so far, or in the kept file, retired: it signs
        no call or open from then on (a call stands at no position in a log), whatever this process's roster copy
        says."""
        return self.views().retired

    async def start(self, catch_up_timeout_s: float = steward_keys_catch_up_s) -> None:
        """Start following, the kept file read first; return once every stream was read to its end, or after
        `catch_up_timeout_s` (said)."""
        if self.kept_file is not None:
            self._kept_keys, kept = await asyncio.to_thread(load_kept_removals, self.kept_file, self._verifier)
            self._views = None
            self._kept = {(removal.stream, removal.seq): removal for removal in kept}
        self._tasks = [asyncio.create_task(self._follow(stream), name=f"steward-keys-{stream}")
                       for stream in self.streams]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(catch_up_timeout_s):
                await asyncio.gather(*(caught_up.wait() for caught_up in self._caught_up.values()))
        behind = [stream for stream, caught_up in self._caught_up.items() if not caught_up.is_set()]
        if behind:
            log.warning("the removals of %s were not read within %.0f s: until they are, a steward key they rotate "
                        "counts for signed calls and opens as the roster says", ", ".join(behind), catch_up_timeout_s)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _follow(self, stream: str) -> None:
        next_seq, retry_s = 1, retry_initial_s
        while True:
            # First to the end as it stands (so start() knows when it has caught up), then following it.
            follow = self._caught_up[stream].is_set()
            try:
                messages = read_stream(self._js, stream, from_seq=next_seq, follow=follow,
                                       subject_filter=MEMBER_REMOVAL_SUBJECTS[stream])
                async with contextlib.aclosing(messages) as reader:
                    async for message in reader:
                        next_seq = message.seq + 1
                        if self._take_in(message) and follow:
                            await self._write_kept()
                        retry_s = retry_initial_s
                if not follow:
                    await self._write_kept()  # once for all the catch-up read learned
                    self._caught_up[stream].set()
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the follower must outlive any broker or stream trouble
                log.warning("steward keys: reading %s's removals from seq %d failed (%s: %s); retrying in %.1f s",
                            stream, next_seq, type(error).__name__, error, retry_s)
            await asyncio.sleep(retry_s)
            retry_s = min(retry_s * 2, retry_max_s)

    def _take_in(self, message: Any) -> bool:
        """Judge and record a removal read from a stream; True when it counted there (verified, and the first of its
        key on its stream): it is then added to what the kept file is to hold."""
        if not isinstance(message, StoredEvent) or not isinstance(message.event, MemberChange):
            return False
        if self._logged.rejection(self._verifier, message) is not None:
            return False
        if not counts_on_its_stream(self._logged, message.event):
            return False
        newly_retired = isinstance(message.event, MemberRemoved) and \
            not self._retired_on_some_stream(message.event.public_key)
        self._logged.record(message.event)
        self._views = None  # built again when next asked
        if newly_retired:
            for listener in self.retirement_listeners:
                listener(message.event)
        if self.kept_file is not None and (message.stream, message.seq) not in self._kept:
            self._kept[(message.stream, message.seq)] = KeptRemoval.of(message)
            self._kept_written = False
        return True

    def _retired_on_some_stream(self, key: str) -> bool:
        """Whether retired_keys() holds `key`, without building the views again for each change read while catching
        up (a verified change counts only on a stream of MEMBER_REMOVAL_SUBJECTS)."""
        return any((stream, key) in keys.removed for keys in (self._logged, self._kept_keys)
                   for stream in MEMBER_REMOVAL_SUBJECTS)

    async def _write_kept(self) -> None:
        """Write what was learned since the last write to the kept file (a failed write is said, never fatal: the
        streams still hold it, and the next write tries again)."""
        async with self._writing:
            if self.kept_file is None or self._kept_written:
                return
            self._kept_written = True
            writing = dict(self._kept)
            try:
                written = await asyncio.to_thread(write_kept_removals, self.kept_file, list(writing.values()))
            except OSError as error:
                self._kept_written = False
                log.warning("retired keys: the removals learned could not be kept in %s (%s); they count while the "
                            "streams hold them", self.kept_file, error)
                return
            # Over the file's bounds: what was left out is not held here either.
            for position in writing.keys() - {(removal.stream, removal.seq) for removal in written}:
                del self._kept[position]
