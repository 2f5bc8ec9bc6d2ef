"""ReadySteps: the complete steps a receiver holds for its consumer, bounded in count and in the memory they hold."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from hearth.services.transport.frames import ReceivedStep

# Complete steps waiting for the consumer hold at most this many steps of the largest size in memory, whatever their
# count may be (a tap has thousands of places): a sender that ignores the window, or fills every place with the largest
# steps its pipeline allows, makes the receiver wait (backpressure), never hold gigabytes.
ready_budget_steps = 2


class ReadySteps:
    """At most `max_steps` complete steps, in arrival order, whose tensors hold at most `max_bytes` together; one step
    always fits when none waits, whatever its size."""

    def __init__(self, max_steps: int, max_bytes: int) -> None:
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._steps: deque[ReceivedStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[ReceivedStep]:
        return iter(self._steps)

    def room_for(self, received: ReceivedStep) -> bool:
        """Whether `received` may join the steps waiting now: a place, and room in the bytes they may hold."""
        if len(self._steps) >= self.max_steps:
            return False
        return not self._steps or self.held_bytes + _tensor_bytes(received) <= self.max_bytes

    def append(self, received: ReceivedStep) -> None:
        self._steps.append(received)
        self.held_bytes += _tensor_bytes(received)

    def popleft(self) -> ReceivedStep:
        received = self._steps.popleft()
        self.held_bytes -= _tensor_bytes(received)
        return received

    def take_all(self) -> list[ReceivedStep]:
        taken = list(self._steps)
        self._steps.clear()
        self.held_bytes = 0
        return taken


def _tensor_bytes(received: ReceivedStep) -> int:
    """The memory a complete step's restored tensor holds (none for a reset)."""
    tensor = received.tensor
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
