"""Scripted stand-ins for orchestrators over a real nats-server, each answering the queue group's subject and its own
(hearth/services/client/pinned.py, the gateway's and the Node.js client's pins are tested against them)."""

from __future__ import annotations

import json
from collections import defaultdict

from hearth.protocol.chat import ChatRequest
from hearth.protocol.subjects import CHAT_REQUEST_SUBJECT, orchestrator_request_subject
from hearth.services.broker.connection import flush_ordered

QUEUE = "hearth-orchestrators"


def done(name: str) -> dict:
    return {"type": "done", "seq": 1, "finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "orchestrator": name}


class ScriptedOrchestrators:
    """Stand-ins for orchestrators: each answers a token ("ok") and a done frame naming it, or what `answers` scripts
    for it (an empty script: it stays silent); `heard` lists, per orchestrator, the subjects its calls came on."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.answers: dict[str, list[dict]] = {}
        self.heard: dict[str, list[str]] = defaultdict(list)
        self.requests: list[ChatRequest] = []

    async def start(self, name: str, *, in_queue: bool = True) -> None:
        async def answer(msg) -> None:
            self.heard[name].append(msg.subject)
            self.requests.append(ChatRequest.model_validate_json(msg.data))
            frames = self.answers.get(name, [{"type": "token_delta", "seq": 0, "text": "ok", "token_id": 1},
                                             done(name)])
            for frame in frames:
                await self.nc.publish(msg.reply, json.dumps(frame).encode())

        if in_queue:
            await self.nc.subscribe(CHAT_REQUEST_SUBJECT, queue=QUEUE, cb=answer)
        await self.nc.subscribe(orchestrator_request_subject(name), queue=QUEUE, cb=answer)
        await flush_ordered(self.nc)
