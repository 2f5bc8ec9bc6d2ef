"""The soak under faults: continuous greedy chat load with known answers on a mesh of real processes while a fault
injector breaks and heals it, every call classified, then the end checks, written as report.json and a timeline.

A call is `identical` (done, the reference tokens), `documented` (ended with a code docs/protocol.md gives for a
fault, within that code's bound), `wrong` (done with other tokens) or `unexplained` (anything else: an exception,
another code, a documented one too late). See docs/operations.md, "Soak under faults"."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hearth.protocol.chat import ChatParams, ChatRequest
from hearth.services.broker.connection import connect_nats
from hearth.services.common.config import ClientSettings
from hearth.services.common.config_processes import OrchestratorSettings
from hearth.services.devtools.random_models import random_checkpoint
from hearth.services.devtools.soak_checks import (
    CheckResult,
    final_checks,
    memory_trends,
    read_rss_mib,
    rss_min_judged_load_s,
)
from hearth.services.devtools.soak_faults import FaultInjector
from hearth.services.devtools.netbed import unavailable_reason
from hearth.services.devtools.soak_mesh import SoakMesh

SOAK_MODEL = "random:tiny"
CONCURRENT_CHATS = 3
MAX_TOKENS = 16
# One prompt per chat loop: each has its own known answer.
PROMPTS = tuple(" ".join(f"t{(loop * 37 + word * 11) % 400 + 1}" for word in range(6 + loop))
                for loop in range(CONCURRENT_CHATS))
rss_sample_interval_s = 3.0
# Slack on every bound: a loaded two-core machine is slow to notice and to answer.
ending_slack_s = 20.0
_client = ClientSettings()
_orchestrator = OrchestratorSettings()
# The codes docs/protocol.md gives for a fault, and the longest wait before each may come: a silence the client
# ends (orchestrator_gone), a broker connection waited for (pipeline_stalled), failovers running out
# (shard_unavailable, decided within a broker wait), no shard with room (overloaded).
ENDING_BOUNDS_S = {
    "orchestrator_gone": _client.first_frame_timeout_s + ending_slack_s,
    "pipeline_stalled": _orchestrator.broker_wait_s + ending_slack_s,
    "shard_unavailable": _orchestrator.broker_wait_s + ending_slack_s,
    "overloaded": _orchestrator.at_capacity_max_wait_s + ending_slack_s,
}
OUTCOMES = ("identical", "documented", "wrong", "unexplained")


@dataclass
class CallRecord:
    chat: int
    started_s: float
    ended_s: float
    outcome: str
    code: str | None = None
    detail: str = ""
    longest_token_gap_s: float = 0.0


def chat_request(model: Path, loop: int) -> ChatRequest:
    return ChatRequest(model=str(model), prompt=PROMPTS[loop], max_tokens=MAX_TOKENS, temperature=0.0,
                       params=ChatParams(fallback_to_local=False))


def classify(call, reference: list[int] | None, error: BaseException | None) -> tuple[str, str | None, str]:
    """(outcome, code, detail) of one streamed call (tests/e2e/failover_support.StreamedCall)."""
    if error is not None:
        return "unexplained", None, f"{type(error).__name__}: {error}"
    final = call.final
    if final is None:
        return "unexplained", None, "no frame at all"
    if final.type == "done":
        if call.answer_token_ids == reference:
            return "identical", None, ""
        return "wrong", None, f"tokens {call.answer_token_ids} != reference {reference}"
    code = getattr(final, "code", None)
    detail = str(getattr(final, "reason", None) or getattr(final, "message", ""))[:300]
    if code not in ENDING_BOUNDS_S:
        return "unexplained", code, f"{final.type} {code}: {detail}"
    waited_s = call.arrived_at[-1] - (call.arrived_at[-2] if len(call.arrived_at) > 1 else call.started_at)
    if waited_s > ENDING_BOUNDS_S[code]:
        return "unexplained", code, f"{code} after {waited_s:.1f} s, over its bound {ENDING_BOUNDS_S[code]} s"
    return "documented", code, detail


@dataclass
class Soak:
    """One soak: `run()` returns the report (also written to `out/report.json`)."""

    minutes: float
    seed: int
    out: Path
    log: Callable[[str], None] = print
    calls: list[CallRecord] = field(default_factory=list)
    rss_samples: list[dict] = field(default_factory=list)
    references: list[list[int]] = field(default_factory=list)

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        no_bed = unavailable_reason()
        if no_bed is not None:
            self.log(f"soak: no household test bed ({no_bed}): everything on loopback, no link cuts")
        model = random_checkpoint(SOAK_MODEL)
        mesh = SoakMesh(self.out / "mesh", model)
        try:
            mesh.start(use_bed=no_bed is None)
            self.log(f"soak: mesh up ({'household bed' if mesh.bed else 'loopback'}); load for {self.minutes} min")
            report = asyncio.run(self._run(mesh, model))
            report["bed"] = no_bed or "household test bed (network namespaces)"
        except BaseException:
            (self.out / "process-logs.txt").write_text(mesh.log_tails())
            raise
        finally:
            mesh.close()
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        from hearth.services.devtools.soak_plot import draw_timeline

        draw_timeline(report, self.out / "timeline.png")
        return report

    async def _run(self, mesh: SoakMesh, model: Path) -> dict:
        began_at = time.monotonic()
        nc = await connect_nats(mesh.cluster.nats_url, name="soak-load", settings=mesh.cluster.nats_settings())
        try:
            self.references = [await self._reference(nc, model, loop) for loop in range(CONCURRENT_CHATS)]
            load_began = time.monotonic()
            until = load_began + self.minutes * 60
            injector = FaultInjector(mesh, self.seed, began_at, log=self.log)
            sampler = asyncio.create_task(self._sample_memory(mesh, began_at))
            try:
                await asyncio.gather(injector.run(until),
                                     *(self._chat_loop(nc, model, loop, until, began_at)
                                       for loop in range(CONCURRENT_CHATS)))
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            load_s = time.monotonic() - load_began
            self.log(f"soak: load done ({len(self.calls)} calls, {len(injector.faults)} faults); checking")
        finally:
            async with asyncio.timeout(5):
                await nc.close()
        checks, numbers = await final_checks(mesh)
        return self._report(injector, checks, numbers, load_s, time.monotonic() - began_at)

    async def _reference(self, nc, model: Path, loop: int) -> list[int]:
        from tests.e2e.failover_support import stream_with_action

        call = await stream_with_action(nc, chat_request(model, loop))
        if call.final is None or call.final.type != "done" or len(call.answer_token_ids) != MAX_TOKENS:
            raise RuntimeError(f"the undisturbed reference call {loop} failed: {call.final}")
        return call.answer_token_ids

    async def _chat_loop(self, nc, model: Path, loop: int, until: float, began_at: float) -> None:
        from tests.e2e.failover_support import StreamedCall, stream_with_action

        while time.monotonic() < until:
            started = time.monotonic()
            call, error = StreamedCall(), None
            try:
                call = await stream_with_action(nc, chat_request(model, loop),
                                                first_frame_timeout=_client.first_frame_timeout_s,
                                                frame_gap_timeout=_client.silence_timeout_s)
            except Exception as failure:  # classified as unexplained, with its text
                error = failure
            call.started_at = started
            outcome, code, detail = classify(call, self.references[loop], error)
            self.calls.append(CallRecord(loop, started - began_at, time.monotonic() - began_at, outcome, code, detail,
                                         round(call.longest_token_gap_s(), 3) if call.frames else 0.0))
            if outcome != "identical":
                self.log(f"call of chat {loop}: {outcome} {code or ''} {detail}")

    async def _sample_memory(self, mesh: SoakMesh, began_at: float) -> None:
        while True:
            for name, pid in mesh.long_lived().items():
                rss = read_rss_mib(pid)
                if rss is not None:
                    self.rss_samples.append({"t_s": round(time.monotonic() - began_at, 2), "process": name,
                                             "pid": pid, "rss_mib": round(rss, 2)})
            await asyncio.sleep(rss_sample_interval_s)

    def _report(self, injector: FaultInjector, checks: list[CheckResult], numbers: dict, load_s: float,
                total_s: float) -> dict:
        counts = {outcome: sum(call.outcome == outcome for call in self.calls) for outcome in OUTCOMES}
        trends = memory_trends(self.rss_samples, load_s)
        unhealed = [fault for fault in injector.faults if fault.error]
        checks = [
            CheckResult("no_wrong_answer", counts["wrong"] == 0, f"{counts['wrong']} wrong"),
            CheckResult("no_unexplained_ending", counts["unexplained"] == 0, f"{counts['unexplained']} unexplained"),
            CheckResult("every_fault_healed", not unhealed, "; ".join(f"{f.kind} {f.target}: {f.error}"
                                                                       for f in unhealed)),
            *checks,
            CheckResult("no_memory_trend", not any(t["upward"] for t in trends),
                        f"{len(trends)} process runs judged; upward: "
                        + (", ".join(t["process"] for t in trends if t["upward"]) or "none")
                        if load_s >= rss_min_judged_load_s else
                        f"a load of {load_s / 60:.1f} min is too short to judge (needs {rss_min_judged_load_s / 60:g});"
                        " slopes reported under `memory`"),
        ]
        identical_gaps = [call.longest_token_gap_s for call in self.calls if call.outcome == "identical"]
        return {
            "minutes": self.minutes, "seed": self.seed, "load_s": round(load_s, 1), "total_s": round(total_s, 1),
            "concurrent_chats": CONCURRENT_CHATS, "max_tokens": MAX_TOKENS, "model": SOAK_MODEL,
            "calls": len(self.calls), "outcomes": counts,
            "codes": {code: sum(call.code == code for call in self.calls) for code in ENDING_BOUNDS_S},
            "max_failover_pause_s": max(identical_gaps, default=0.0),
            "faults": [fault.as_dict() for fault in injector.faults],
            "faults_by_kind": {kind: sum(f.kind == kind for f in injector.faults) for kind in injector.kinds},
            "memory": trends, "rss_samples": self.rss_samples, **numbers,
            "checks": [check.as_dict() for check in checks],
            "passed": all(check.passed for check in checks),
            "call_log": [asdict(call) for call in self.calls],
        }
