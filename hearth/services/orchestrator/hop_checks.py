"""HopChecks: what a call's verifier (hearth/services/orchestrator/verification.py) keeps for one hop of its current
chain: the mirrors that check it, the check running on it, the replicas it no longer asks, what is confirmed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from hearth.services.orchestrator.mirror import Mirror
from hearth.services.orchestrator.recording import ChainRecorder

log = logging.getLogger(__name__)


@dataclass
class HopChecks:
    """The checks of one hop of the current chain."""

    mirrors: list[Mirror] = field(default_factory=list)
    task: asyncio.Task | None = None
    # Another check was asked for while one ran: it runs right after.
    again: bool = False
    # Replicas that failed or lost a dispute on this hop: not asked again in this call.
    avoid: set[str] = field(default_factory=set)
    # The positions before this one were confirmed by a check.
    confirmed_pos: int = 0
    # Its last check found no replica to mirror it: it is not checked meanwhile.
    unmirrored: bool = False
    # The recorder generation one mirror more than its level asks (a witness fed from the start) was last sought in.
    witness_sought_in: int | None = None
    # Held by the check running on it (`turn`).
    _one_check: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @contextlib.asynccontextmanager
    async def turn(self, timeout_s: float | None = None) -> AsyncIterator[None]:
        """Check the hop, one check at a time: a check feeds its mirrors from where they stopped, so two at once (a
        report's and a background one) would feed them the same positions twice. TimeoutError when no turn came
        within `timeout_s` (None: as long as the running check takes, itself bounded)."""
        async with asyncio.timeout(timeout_s):
            await self._one_check.acquire()
        try:
            yield
        finally:
            self._one_check.release()

    async def mirrors_of_run(self, recorder: ChainRecorder, required: int, witness_due: bool,
                             open_mirror: Callable[[set[str]], Awaitable[Mirror | None]]) -> list[Mirror]:
        """The mirrors that check the hop in the chain's run of positions `recorder.generation` (those of an earlier
        run are closed), `required` of them, opened as needed by `open_mirror` (avoiding the replicas given) while the
        record still holds the run from its start (a fresh replica is fed what the hop ran from there); fewer when
        fewer could be had (none: `unmirrored`). A mismatch, or a mirror lost, past what the record forgot has no
        fresh replica to be fed from the start: once the record needs room (`witness_due`; it holds back what it may
        forget until then), one replica more than `required` is fed from the start beside them (sought once per run):
        it settles a mismatch as a vote's second mirror does, and takes the place of a mirror that fails. None found:
        a mismatch is disputed, as on a short prompt, and a mirror lost is not replaced."""
        generation = recorder.generation
        for mirror in [m for m in self.mirrors if m.generation != generation]:
            self.mirrors.remove(mirror)
            await mirror.close()
        wanted = required
        if witness_due and self.witness_sought_in != generation:
            self.witness_sought_in, wanted = generation, required + 1
        while len(self.mirrors) < wanted and recorder.forgot_to == 0:
            mirror = await open_mirror(self.avoid | {m.shard_id for m in self.mirrors})
            if mirror is None:
                break
            self.mirrors.append(mirror)
        # One that finished opening after the record forgot what it would be fed next can check nothing (nor hold the
        # record back); its replica is not to blame.
        for mirror in [m for m in self.mirrors if m.fed_pos < recorder.forgot_to]:
            self.mirrors.remove(mirror)
            await mirror.close()
        self.unmirrored = not self.mirrors
        return list(self.mirrors)

    async def drop(self, mirror: Mirror) -> None:
        """Ask `mirror`'s replica no more in this call, and close it."""
        self.avoid.add(mirror.shard_id)
        if mirror in self.mirrors:
            self.mirrors.remove(mirror)
        with contextlib.suppress(Exception):
            await mirror.close()


def record_needed_from(hops: Sequence[HopChecks], broken: set[int], witness_due: bool, generation: int) -> int:
    """The first position a check of `hops` may still read (ChainRecorder.needed_from): what every hop's mirrors were
    fed, the record may forget (a fresh witness can then not be fed from 0). A hop without a replica to check it, or
    a record (`broken`), holds nothing back (else it would leave the others unchecked past the budget); one whose
    mirrors are still opening does, and so does one whose witness is due (`witness_due`) and not yet sought in this
    run of the chain's positions (`generation`): it is fed from the start once the record needs room."""
    return min((0 if witness_due and hop.witness_sought_in != generation
                else min((mirror.fed_pos for mirror in hop.mirrors), default=0)
                for index, hop in enumerate(hops) if index not in broken and not hop.unmirrored), default=0)


async def end_checks(hops: Sequence[HopChecks]) -> None:
    """Cancel the hops' checks and close their mirrors (the chain is no longer checked)."""
    for hop in hops:
        if hop.task is not None:
            hop.task.cancel()
    await asyncio.gather(*(hop.task for hop in hops if hop.task is not None), return_exceptions=True)
    for hop in hops:
        for mirror in hop.mirrors:
            with contextlib.suppress(Exception):
                await mirror.close()


async def checks_ran(hops: Sequence[HopChecks], timeout_s: float, pipeline_id: str, *, cancel: bool) -> None:
    """Wait for the hops' checks running, at most `timeout_s`; those still running then are cancelled (`cancel`:
    their work left unchecked, their mirrors free for another check) or left running."""
    running = [hop.task for hop in hops if hop.running]
    if not running:
        return
    _, pending = await asyncio.wait(running, timeout=timeout_s)
    if pending:
        log.warning("pipeline %s: %d checks still running after %.0f s%s", pipeline_id, len(pending), timeout_s,
                    "; cancelled, their steps unchecked" if cancel else "")
    if pending and cancel:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
