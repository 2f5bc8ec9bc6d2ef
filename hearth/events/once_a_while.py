"""Remembers when something was last told about each of a bounded number of keys, so that a warning is logged the
first time and again only after a while, never once per message (a member's skewed clock, a newer hearth's events)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable


class OnceAWhile:
    """`due(key)` is True the first time and then once every `every_s`; only the `max_keys` keys told most recently
    are remembered (the keys are the messages' to name)."""

    def __init__(self, every_s: float, max_keys: int, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._max_keys = max_keys
        self._monotonic = monotonic
        self._told_at: OrderedDict[Hashable, float] = OrderedDict()

    def due(self, key: Hashable) -> bool:
        """Whether `key` is to be told now (not told within `every_s`); if so, it counts as told now."""
        now = self._monotonic()
        told_at = self._told_at.get(key)
        if told_at is not None and now - told_at < self.every_s:
            return False
        self._told_at[key] = now
        self._told_at.move_to_end(key)
        while len(self._told_at) > self._max_keys:
            self._told_at.popitem(last=False)
        return True
