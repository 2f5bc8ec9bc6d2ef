"""Which contiguous layer range a `hearth host` serves: the one that fits its memory budget and most improves the
mesh's coverage (least-replicated layers first, as Petals servers choose their blocks), and when to move.

Coverage is read from the read model: how many live replicas (advertised, unexpired, recently heard from, same
weights and quantization scheme) hold each layer, this host's own shards left out (the one it serves, or at its first
choice those of its node that no longer answer: an earlier run's, crashed). All decisions here are pure functions of
that count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass

from hearth.readmodels.queries import ShardCandidate


@dataclass(frozen=True)
class LayerRange:
    lo: int
    hi: int  # inclusive

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"

    def layers(self) -> range:
        return range(self.lo, self.hi + 1)


def replicas_per_layer(shards: Iterable[ShardCandidate], *, total_layers: int, weights_sha256: str,
                       alive: Callable[[ShardCandidate], bool], leave_out: Set[str] = frozenset(),
                       quantization: str = "none") -> list[int]:
    """Live replicas of each layer among `shards` (one model's) that serve its weights in `quantization` (a
    pipeline never mixes schemes), the shards `leave_out` (this host's) not counted, and one node's shards once per
    layer: a member may advertise any number of shards, and its many adverts of layers must not pass for replicas
    that keep honest hosts away from them (or herd them from range to range)."""
    replicas = [0] * total_layers
    counted: set[tuple[str, int]] = set()
    for shard in shards:
        if (shard.shard_id in leave_out or shard.weights_sha256 != weights_sha256
                or shard.quantization != quantization or not alive(shard)):
            continue
        for layer in range(max(shard.layer_lo, 0), min(shard.layer_hi, total_layers - 1) + 1):
            if (shard.node_id, layer) not in counted:
                counted.add((shard.node_id, layer))
                replicas[layer] += 1
    return replicas


def widest_fit(lo: int, layer_bytes: list[int], budget_bytes: int) -> int | None:
    """The last layer of the longest range starting at `lo` whose weights fit `budget_bytes`; None if none does."""
    total, hi = 0, None
    for index in range(lo, len(layer_bytes)):
        total += layer_bytes[index]
        if total > budget_bytes:
            break
        hi = index
    return hi


def _score(window: LayerRange, replicas: list[int]) -> tuple:
    counts = [replicas[layer] for layer in window.layers()]
    # Most uncovered layers first, then the longest range, then the least replicated, then the lowest layers.
    return (-sum(1 for count in counts if count == 0), -len(counts), sum(counts), window.lo)


def _windows(total_layers: int, layer_bytes: list[int], budget_bytes: int,
             keeping: Sequence[int] = ()) -> list[LayerRange]:
    """The widest range that fits from each start, of those that hold every layer of `keeping`."""
    windows = []
    for lo in range(min(keeping, default=total_layers - 1) + 1):
        hi = widest_fit(lo, layer_bytes, budget_bytes)
        if hi is not None and hi >= max(keeping, default=lo):
            windows.append(LayerRange(lo, hi))
    return windows


def choose_range(replicas: list[int], layer_bytes: list[int], budget_bytes: int,
                 keeping: Sequence[int] = ()) -> LayerRange | None:
    """The range this host should load: of the widest ranges that fit from each start (and hold every layer of
    `keeping`), the best for coverage."""
    windows = _windows(len(replicas), layer_bytes, budget_bytes, keeping)
    if not windows:
        return None
    return min(windows, key=lambda window: _score(window, replicas))


def fits_as_chosen(candidate: LayerRange, layer_bytes: list[int], budget_bytes: int) -> bool:
    """Whether `candidate` is a range choose_range could still choose: the widest that fits from its start."""
    return candidate.hi < len(layer_bytes) and widest_fit(candidate.lo, layer_bytes, budget_bytes) == candidate.hi


def choose_range_remembering(replicas: list[int], layer_bytes: list[int], budget_bytes: int,
                             remembered: LayerRange | None) -> LayerRange | None:
    """choose_range, but `remembered` (the range this host last served) when it is still one choose_range could
    choose (fits_as_chosen) and either no live replica holds any of its layers or it is as good for coverage as the
    best choice, the lowest layers' tie-break aside: hosts restarted together (a power cut) each see an empty mesh
    and would all choose the same lowest range, then spread out one move at a time; each takes its old one back. A
    preference, never an override: it joins no layers another host holds unless choose_range's rules rank it
    level with their best."""
    best = choose_range(replicas, layer_bytes, budget_bytes)
    if remembered is None or best is None or not fits_as_chosen(remembered, layer_bytes, budget_bytes):
        return best
    if uncovered(replicas, remembered) == len(remembered.layers()):
        return remembered
    return remembered if _score(remembered, replicas)[:-1] == _score(best, replicas)[:-1] else best


def uncovered(replicas: list[int], window: LayerRange) -> int:
    return sum(1 for layer in window.layers() if replicas[layer] == 0)


def better_range(current: LayerRange, replicas_without_me: list[int], layer_bytes: list[int],
                 budget_bytes: int) -> LayerRange | None:
    """A range worth moving to, or None: one that keeps every layer of `current` with no other replica (a move
    never drops a last replica; a host with budget to spare may widen over a hole next to them) and holds more
    layers nobody else serves than `current` does (it fills some of a hole, so balanced meshes stay put, and each
    move leaves fewer uncovered layers: moves cannot go back and forth)."""
    if not any(count == 0 for count in replicas_without_me):
        return None
    last_replicas = [layer for layer in current.layers() if replicas_without_me[layer] == 0]
    candidate = choose_range(replicas_without_me, layer_bytes, budget_bytes, keeping=last_replicas)
    if candidate is None or candidate == current:
        return None
    gain = uncovered(replicas_without_me, candidate) - uncovered(replicas_without_me, current)
    return candidate if gain > 0 else None


def shifted_range(current: LayerRange, replicas_without_me: list[int], layer_bytes: list[int],
                  budget_bytes: int) -> LayerRange | None:
    """A range one step nearer the lowest layer nobody holds, or None: the move that lets a chain of hosts close a
    hole none of them can fill alone (budgets of 1, 2, 2, 2 layers of six on 1-2, 3-4, 4-5 and layer 0 missing:
    3-4 shifts to 2-3, then 1-2 may drop layer 2 and fill 0-1). It keeps every layer of `current` with no other
    replica, as better_range does, and covers no hole (better_range's moves come first), so the layers nobody
    holds stay the same and so does the lowest of them; each such move brings one host strictly nearer it (a range
    above it to a lower start, one below it to a higher end, never across it): with the uncovered layers, which no
    move adds to, that distance summed over the hosts only falls, so moves end, and none is made without a hole."""
    holes = [layer for layer, count in enumerate(replicas_without_me) if count == 0 and layer not in current.layers()]
    if not holes:
        return None
    hole = holes[0]
    last_replicas = [layer for layer in current.layers() if replicas_without_me[layer] == 0]
    windows = _windows(len(replicas_without_me), layer_bytes, budget_bytes, keeping=last_replicas)
    if current.lo > hole:  # the nearest lower start that stays above the hole
        return max((window for window in windows if hole < window.lo < current.lo),
                   key=lambda window: window.lo, default=None)
    return min((window for window in windows if current.hi < window.hi < hole),  # the nearest higher end below it
               key=lambda window: window.hi, default=None)


def next_range(current: LayerRange, replicas_without_me: list[int], layer_bytes: list[int],
               budget_bytes: int) -> LayerRange | None:
    """Where a host holding `current` should move while some layer has no replica (None: stay): a range that fills
    some of the hole (better_range), else one a step nearer it (shifted_range). Once every layer is held, nowhere."""
    return (better_range(current, replicas_without_me, layer_bytes, budget_bytes)
            or shifted_range(current, replicas_without_me, layer_bytes, budget_bytes))
