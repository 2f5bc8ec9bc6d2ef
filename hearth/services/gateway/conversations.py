"""Which orchestrator answered each conversation the gateway carried lately (ConversationPins), so that a request
going on with one is sent to that orchestrator first: only its member's hops may attach the history's kept KV
(docs/design.md §13). A bounded map from a digest of the caller and the conversation so far, least recently used
forgotten first; it holds no text, and a wrong or forgotten entry costs only a prefill."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from hearth.protocol.chat import ChatMessage, ChatRequest

digest_bytes = 16


def conversation_digest(member: str | None, model: str | None, messages: list[ChatMessage]) -> bytes:
    """A digest of `messages` as `member` sent them to `model`: another member's identical history is another key."""
    canonical = json.dumps([member, model, [message.model_dump(mode="json", exclude_none=True)
                                            for message in messages]], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=digest_bytes).digest()


def history_before_last_answer(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The messages before the last assistant message: what the request that got that answer sent (None: no
    assistant message, so a conversation's first turn)."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "assistant":
            return messages[:index]
    return None


class ConversationPins:
    """Conversation digest -> the node id of the orchestrator that answered it, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pins: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def pinned(self, member: str | None, request: ChatRequest) -> str | None:
        """The orchestrator that answered the turn `request` goes on from, when remembered."""
        history = history_before_last_answer(request.messages) if request.messages else None
        if not history:
            return None
        key = conversation_digest(member, request.model, history)
        orchestrator = self._pins.get(key)
        if orchestrator is not None:
            self._pins.move_to_end(key)
        return orchestrator

    def remember(self, member: str | None, request: ChatRequest, orchestrator: str) -> None:
        """`orchestrator` answered `request`: its conversation's next turn goes there."""
        if not request.messages or self.capacity == 0:
            return
        key = conversation_digest(member, request.model, request.messages)
        self._pins[key] = orchestrator
        self._pins.move_to_end(key)
        while len(self._pins) > self.capacity:
            self._pins.popitem(last=False)
