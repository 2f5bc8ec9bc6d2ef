"""A request's `n` choices are served in one weight scheme: the one the first choice's chain was built on, when the
request named none. Each choice used to pick the most precise scheme with room for itself, so on a mesh whose
full-precision shards were busy with the first choice the others ran int8: a greedy request's choices differed, and
none began from the prompt's blocks the first choice's hops kept."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hearth.protocol.chat_frames import DoneFrame, Usage
from hearth.services.orchestrator import choices
from hearth.services.orchestrator.choices import ChoiceClient, ChoiceGroup
from tests.orchestrator_stand_ins import RecordingClient


class _SchemeRun:
    """A choice whose chain is built on the most precise scheme with room: `none` for the first, which then holds
    the only full-precision room (what ChainBuilder.build does with `call.quantization`)."""

    served_in: dict[str, str] = {}

    def __init__(self, call, ctx) -> None:
        self.call = call
        self.on_first_token = None

    async def serve(self) -> None:
        if self.call.quantization is None:
            self.call.quantization = "none" if self.on_first_token is not None else "int8"
        type(self).served_in[self.call.pipeline_id] = self.call.quantization
        if self.on_first_token is not None:
            await self.on_first_token(self)
        await self.call.client.send(DoneFrame(seq=0, finish_reason="length",
                                              usage=Usage(prompt_tokens=1, completion_tokens=1)))

    async def close(self) -> None:
        pass


async def _prefilled(group: ChoiceGroup) -> None:
    group._prefilled.set()


async def test_every_choice_is_served_in_the_first_choices_scheme(monkeypatch):
    monkeypatch.setattr(choices, "PipelineRun", _SchemeRun)
    monkeypatch.setattr(ChoiceGroup, "_share_prefill", lambda self, run: _prefilled(self))
    group = ChoiceGroup(RecordingClient(), ctx=None)
    calls = [SimpleNamespace(pipeline_id=f"p{index}", client=ChoiceClient(group, index), quantization=None)
             for index in range(3)]

    await asyncio.wait_for(group.serve(calls), timeout=10)

    assert _SchemeRun.served_in == {"p0": "none", "p1": "none", "p2": "none"}
