"""ShardRouter: picks the chain of shards covering every layer of a model, from the read model (docs/design.md §5).

Rules, in order:
1. candidates are the shards of the model with matching weights_sha256 and one quantization scheme (the
   request's, else the most precise one whose shards cover every layer: none, int8, int4; a call's failover
   keeps its scheme) that are advertised (not withdrawn),
   not expired (`now < expires_at`), alive (latest heartbeat, or the advertisement itself when no heartbeat
   came yet, at most `health_timeout_s` old), where "now" is the wall clock held back to the newest heartbeat the
   read model has heard, for at most `silent_log_grace_s` (a silent event log is not dead shards: while the
   heartbeats' stream elects a leader or a restarted projector catches up, every shard would look stale at once;
   a shard silent while others are heard goes stale as before; one whose latest heartbeat, applied or rejected
   `future_dated`, was dated beyond `max_clock_skew_s` of when the broker stored it is said to be left out for its
   host's clock), not quarantined (a confirmed mismatch that no
   steward has cleared: hearth/readmodels/reputation.py) and on a node none of whose shards is quarantined (a
   quarantine holds the node: a shard restarted under another range or scheme is still held), held by a current
   member of the community's roster (a removed member's shards are left out at once, by the roster or the event
   log's removal of its key, not when their heartbeats age), not excluded, and with room by this orchestrator's live
   knowledge (ShardLoad: the streams it holds there and recent `at_capacity` refusals; a heartbeat's
   `active_streams` is seconds old and not used);
2. the chain covering every layer with the least predicted time per token, by dynamic programming over
   layer ranges (hearth/services/orchestrator/predict.py: each shard's measured decode step time from its
   heartbeat, the round trip this orchestrator measured to it, and its queue, which also spreads load
   over replicas); a hop may run part of its shard's range; for a call whose `verify` level asks other replicas
   to check each hop, first the chain whose hops lack the fewest such replicas (predict.py `MirrorShortfall`), so
   a whole-model replica beside partial shards is not routed alone, where nobody could check it (nor moved onto
   it by a conversation's kept prefix: affinity.py);
3. a shard on the orchestrator's own node is not hop 0 unless `allow_self_as_shard`;
4. a layer no candidate can run is `shard_unavailable`, or `weights_mismatch` when a shard with other
   weights would otherwise have been usable (of a scheme the call may be served in); the message names the
   uncovered layers (and the scheme), and the shards holding them that were left out, each with why; a requested
   scheme no live shard serves is `shard_unavailable` naming it (and the shards of it that were left out, each
   with why).

All instants are epoch seconds (the read model floors them to whole seconds). Rule 1 is repeated in SQL for the
dashboards and `hearth status` (hearth/services/dashboards/routing_sql.py): change both together
(tests/unit/test_dashboard_routing_view.py compares them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.orm import Session

from hearth.events.clock_skew import skew_in_words
from hearth.readmodels.queries import (ShardCandidate, all_shards, newest_sign_of_life, quarantined_among,
                                      shards_of_model)
from hearth.protocol.mesh_protocol import mesh_protocol_refusal
from hearth.protocol.quarantine import node_quarantine_reason
from hearth.protocol.quantization_labels import accepts, precision_order
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.predict import HopCosts, MirrorShortfall, cheapest_chain

RoutingErrorCode = Literal["shard_unavailable", "weights_mismatch", "overloaded"]


@dataclass(frozen=True)
class Hop:
    """One step of a pipeline: which shard, how to reach it, and the exact layers (inclusive) it must run."""

    shard_id: str
    control_subject: str
    node_id: str
    layer_lo_to_run: int
    layer_hi_to_run: int
    # The weight quantization scheme of the shard; every hop of a chain has the same one.
    quantization: str = "none"


# How much of the words a shard was excluded with (its refusal's, say) a routing failure repeats for it.
MAX_EXCLUSION_CHARS = 300


class RoutingError(Exception):
    """No pipeline can be built; `code` is the client-facing error code of docs/protocol.md."""

    def __init__(
        self, code: RoutingErrorCode, message: str, *, uncovered_layers: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.uncovered_layers = uncovered_layers


def format_layer_ranges(layers: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    ranges: list[list[int]] = []
    for layer in sorted(set(layers)):
        if ranges and layer == ranges[-1][1] + 1:
            ranges[-1][1] = layer
        else:
            ranges.append([layer, layer])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def judged_instant(wall_s: float, newest_heard_s: float | None, silent_log_grace_s: float) -> float:
    """The instant shards' heartbeats and expiries are judged against: the wall clock, held back to the newest sign
    of life the read model has heard while the log has been silent for at most `silent_log_grace_s` (never ahead
    of the wall clock, so a host whose clock runs ahead changes nothing)."""
    if newest_heard_s is None:
        return wall_s
    return min(wall_s, max(newest_heard_s, wall_s - silent_log_grace_s))


class ShardRouter:
    """Every `pick` reads the current read model through `session_factory`; between reads it holds only the newest
    sign of life the last one saw (what `now` judges health against). Given `read_model_version` (what changes
    whenever the read model does: the projector's count of applied batches), a model's shards read under the version
    the last read saw are that read's, without a query; the version is taken before a query, so a read racing a
    projector's commit is read again next time."""

    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        health_timeout_s: float,
        allow_self_as_shard: bool,
        self_node_id: str,
        clock: Callable[[], float] = time.time,
        max_hops: int | None = None,
        silent_log_grace_s: float = 0.0,
        read_model_version: Callable[[], int] | None = None,
        node_membership: Callable[[str], str | None] | None = None,
        max_clock_skew_s: float | None = None,
    ) -> None:
        self._session_factory = session_factory
        self._read_model_version = read_model_version
        # Why a node's member may not serve (removed from the community's roster), None on an open mesh.
        self._node_membership = node_membership
        # model id -> (the version it was read under, its shards, the newest sign of life then)
        self._reads: dict[str, tuple[int, list[ShardCandidate], float | None]] = {}
        self.health_timeout_s = health_timeout_s
        self.silent_log_grace_s = silent_log_grace_s
        self._newest_heard_s: float | None = None
        self.allow_self_as_shard = allow_self_as_shard
        self.self_node_id = self_node_id
        self._clock = clock
        self.max_hops = max_hops
        # [events] max_clock_skew_s: a shard gone stale or expired while its heartbeats were dated farther off the
        # broker's clock is left out because of its host's clock, and told so (None: not said).
        self.max_clock_skew_s = max_clock_skew_s

    def pick(self, model_id: str, weights_sha256: str, exclude: Iterable[str] = (),
             quantization: str | None = None) -> list[Hop]:
        """The hops covering layers 0..total_layers-1 of `model_id`, or RoutingError."""
        return self.plan(self.candidates(model_id), model_id, weights_sha256, exclude=exclude, now=self.now(),
                         quantization=quantization)

    def candidates(self, model_id: str) -> list[ShardCandidate]:
        """One read of the model's shards from the read model (`plan` decides on them, as often as needed)."""
        version = self._read_model_version() if self._read_model_version is not None else None
        last = self._reads.get(model_id)
        if last is not None and last[0] == version:
            self._newest_heard_s = last[2]
            return list(last[1])
        with self._session_factory() as session:
            newest, shards = newest_sign_of_life(session), shards_of_model(session, model_id)
        self._newest_heard_s = newest
        if version is not None:
            self._reads[model_id] = (version, shards, newest)
        return list(shards)

    def all_candidates(self) -> list[ShardCandidate]:
        """One read of every model's shards (model discovery)."""
        with self._session_factory() as session:
            self._newest_heard_s = newest_sign_of_life(session)
            return all_shards(session)

    def quarantined(self, shard_ids: Iterable[str]) -> set[str]:
        """Which of `shard_ids` the read model holds quarantined."""
        with self._session_factory() as session:
            return quarantined_among(session, sorted(shard_ids))

    def now(self) -> float:
        """The instant `alive` judges shards read since the last `candidates` against (`judged_instant`)."""
        return judged_instant(self._clock(), self._newest_heard_s, self.silent_log_grace_s)

    def alive(self, shard: ShardCandidate, now: float) -> bool:
        """Advertised, of this orchestrator's mesh protocol, not expired, not quarantined (nor any shard of its
        node), and heard from within the health timeout (busy or not): a quarantined shard, and every shard of its
        node, is to routing and model discovery not there."""
        return self.not_alive_because(shard, now) is None

    def not_alive_because(self, shard: ShardCandidate, now: float) -> str | None:
        """Why `shard` is not alive at `now`, in a few words (None: it is)."""
        if shard.status != "advertised":
            return shard.status
        if shard.quarantined:
            return "quarantined"
        if shard.node_quarantined_by is not None:
            return node_quarantine_reason(shard.node_id, shard.node_quarantined_by)
        not_a_member = self.why_not_a_member(shard.node_id)
        if not_a_member is not None:
            return not_a_member
        other_version = mesh_protocol_refusal(shard.protocol, "it")
        if other_version is not None:
            return other_version
        if now >= shard.expires_at:
            return self.clock_off(shard) or f"advert expired {now - shard.expires_at:.0f} s ago"
        # The advertisement is itself a sign of life, so a shard is routable before its first heartbeat.
        last_seen = max(shard.advertised_at, shard.last_seen or shard.advertised_at)
        if now - last_seen > self.health_timeout_s:
            return self.clock_off(shard) or \
                f"not heard from for {now - last_seen:.0f} s (health_timeout_s={self.health_timeout_s:g})"
        return None

    def why_not_a_member(self, node_id: str) -> str | None:
        """Why `node_id`'s member may not serve shards now (removed, its key retired), None when it may."""
        return self._node_membership(node_id) if self._node_membership is not None else None

    def clock_off(self, shard: ShardCandidate) -> str | None:
        """Why `shard`, stale or expired, is so when its latest heartbeat was dated beyond `max_clock_skew_s` of when
        the broker stored it: read as old (behind), or rejected `future_dated` (ahead). None: its clock is not off."""
        skew_s = shard.clock_skew_s
        if self.max_clock_skew_s is None or skew_s is None or abs(skew_s) <= self.max_clock_skew_s:
            return None
        off = skew_in_words(skew_s, "the broker's")
        return f"its clock is {off} (at most {self.max_clock_skew_s:g} s allowed)"

    def plan(
        self,
        shards: list[ShardCandidate],
        model_id: str,
        weights_sha256: str,
        *,
        exclude: Mapping[str, str] | Iterable[str] = (),
        now: float,
        load: ShardLoad | None = None,
        quantization: str | None = None,
        model_layers: int | None = None,
        mirrors_per_hop: int = 0,
    ) -> list[Hop]:
        """The routing decision itself, on rows already read (pure, for tests and what-if tools); `load`: the
        live room of each shard (None: every live shard has room); `quantization`: the scheme the chain must
        serve (a label of hearth/protocol/quantization_labels.py; None: the most precise one that covers);
        `model_layers`: the layers of the model as the orchestrator loaded it (None: as the shards advertise), so
        one shard advertising another count cannot make the model unroutable; `exclude`: shards not to use, each
        with why when a mapping (a failure to route repeats it); `mirrors_per_hop`: the other replicas the call's
        `verify` level has check each hop (check_policy.py MIRRORS_PER_LEVEL), which the chain should have."""
        left_out = self.left_out(shards, exclude, now=now, load=load, model_layers=model_layers)
        usable = [s for s in shards if s.shard_id not in left_out]
        same_weights = [s for s in usable if s.weights_sha256 == weights_sha256]
        mismatched = [s for s in usable if s.weights_sha256 != weights_sha256]
        total_layers = _total_layers(same_weights) or _total_layers(mismatched) or _total_layers(shards)
        if total_layers is None:
            raise RoutingError(
                "shard_unavailable", f"no shard of model {model_id!r} has been advertised"
            )
        total_layers = model_layers or total_layers
        schemes = sorted({s.quantization for s in same_weights if accepts(quantization, s.quantization)},
                         key=precision_order)
        if quantization is not None and not schemes and same_weights:
            served = ", ".join(sorted({s.quantization for s in same_weights}, key=precision_order))
            held = sorted(f"{s.shard_id}: {left_out[s.shard_id]}" for s in shards if s.shard_id in left_out
                          and s.weights_sha256 == weights_sha256 and accepts(quantization, s.quantization))
            raise RoutingError("shard_unavailable", f"no healthy shard of {model_id!r} serves quantization "
                                                    f"{quantization!r} (served now: {served})"
                                                    + (f"; left out: {'; '.join(held)}" if held else ""))
        too_many_hops: list[Hop] | None = None
        for scheme in schemes:
            candidates = [s for s in same_weights if s.quantization == scheme]
            chain = cheapest_chain(
                candidates, HopCosts(candidates, total_layers, load),
                may_be_hop_zero=lambda s: self.allow_self_as_shard or s.node_id != self.self_node_id,
                shortfall=MirrorShortfall(candidates, mirrors_per_hop) if mirrors_per_hop else None,
            )
            if chain is None:
                continue
            hops = [Hop(shard_id=p.shard.shard_id, control_subject=p.shard.control_subject,
                        node_id=p.shard.node_id, layer_lo_to_run=p.layer_lo, layer_hi_to_run=p.layer_hi,
                        quantization=scheme) for p in chain]
            if self.max_hops is None or len(hops) <= self.max_hops:
                return hops
            too_many_hops = too_many_hops or hops
        if too_many_hops is not None:
            raise RoutingError(
                "shard_unavailable",
                f"covering the {total_layers} layers of {model_id!r} needs {len(too_many_hops)} shards, "
                f"more than max_shards_per_request={self.max_hops}",
            )
        # The scheme that came closest names the uncovered layers (the most precise of equals).
        scheme = min(schemes, default=quantization, key=lambda label: (
            -_covered_layer_count([s for s in same_weights if s.quantization == label], total_layers),
            precision_order(label)))
        candidates = [s for s in same_weights if s.quantization == scheme]
        named = quantization is not None or len(schemes) > 1 or scheme not in (None, "none")
        # Other weights count against ours only in a scheme the call may be served in: a shard of another scheme
        # would not have joined its chain had its weights been ours.
        mismatched = [s for s in mismatched if accepts(quantization, s.quantization)]
        self._fail(model_id, weights_sha256, candidates, mismatched, total_layers, 0,
                   scheme=scheme if named else None,
                   left_out=[(s, left_out[s.shard_id]) for s in shards if s.shard_id in left_out
                             and s.weights_sha256 == weights_sha256 and (scheme is None or s.quantization == scheme)])

    def usable(self, shards: list[ShardCandidate], weights_sha256: str, *,
               exclude: Mapping[str, str] | Iterable[str] = (), now: float, load: ShardLoad | None = None,
               model_layers: int | None = None) -> list[ShardCandidate]:
        """The shards of `weights_sha256` that `plan`, given the same arguments, may build a chain of (any scheme):
        what else weighs chains (a kept prefix's, affinity.py) weighs them over, so a shard routing leaves out can
        neither be a hop of such a chain nor count as a replica checking one."""
        left_out = self.left_out(shards, exclude, now=now, load=load, model_layers=model_layers)
        return [s for s in shards if s.shard_id not in left_out and s.weights_sha256 == weights_sha256]

    def left_out(self, shards: list[ShardCandidate], exclude: Mapping[str, str] | Iterable[str], *, now: float,
                 load: ShardLoad | None, model_layers: int | None) -> dict[str, str]:
        """Why routing does not use each of `shards` it leaves out now (`left_out_because`, and an advertised layer
        count other than `model_layers`, the model's as the orchestrator loaded it), by shard id."""
        excluded = dict(exclude) if isinstance(exclude, Mapping) else dict.fromkeys(exclude, "")
        left_out = {s.shard_id: why for s in shards if (why := self.left_out_because(s, excluded, now, load))}
        if model_layers is not None:
            left_out.update({s.shard_id: f"advertises {s.total_layers} layers; the model has {model_layers}"
                             for s in shards if s.total_layers != model_layers and s.shard_id not in left_out})
        return left_out

    def left_out_because(self, shard: ShardCandidate, excluded: Mapping[str, str], now: float,
                         load: ShardLoad | None) -> str | None:
        """Why routing does not use `shard` now (None: usable): `excluded`, not alive, or without room by `load`."""
        if shard.shard_id in excluded:
            # Often a shard's own words (its refusal's message): on one line, whatever it sent.
            why = " ".join(excluded[shard.shard_id].split())
            return f"excluded from this call: {why[:MAX_EXCLUSION_CHARS]}" if why else \
                "excluded from this call (it failed, or a check proved it wrong)"
        why = self.not_alive_because(shard, now)
        if why is None and load is not None and not load.has_room(shard):
            return f"full ({load.held(shard.shard_id)} of {shard.max_concurrent_streams} streams held, or it " \
                   f"answered at_capacity)"
        return why

    def _fail(
        self,
        model_id: str,
        weights_sha256: str,
        candidates: list[ShardCandidate],
        mismatched: list[ShardCandidate],
        total_layers: int,
        cursor: int,
        *,
        scheme: str | None = None,
        left_out: Iterable[tuple[ShardCandidate, str]] = (),
    ) -> None:
        uncovered = [
            layer for layer in range(total_layers)
            if not any(s.layer_lo <= layer <= s.layer_hi for s in candidates)
        ]
        if not uncovered:
            # Every layer has a holder, but the ones holding `cursor` are this node's own, barred from hop 0.
            reach = max(s.layer_hi for s in candidates if s.layer_lo <= cursor <= s.layer_hi)
            uncovered = list(range(cursor, min(reach, total_layers - 1) + 1))
            reason = (
                f"layers {format_layer_ranges(uncovered)} of {model_id!r} are held only by this node "
                f"({self.self_node_id}), which may not be hop 0 (allow_self_as_shard is off)"
            )
            raise RoutingError("shard_unavailable", reason, uncovered_layers=tuple(uncovered))
        layers = format_layer_ranges(uncovered)
        of_model = f"of {model_id!r}" + (f" in quantization {scheme!r}" if scheme else "")
        covered_elsewhere = [
            layer for layer in uncovered if any(s.layer_lo <= layer <= s.layer_hi for s in mismatched)
        ]
        if mismatched:
            others = sorted({s.weights_sha256[:12] for s in mismatched})
            raise RoutingError(
                "weights_mismatch",
                f"no healthy shard with weights {weights_sha256[:12]}… covers layers {layers} "
                f"{of_model}"
                f" ({len(covered_elsewhere)} of them are served with other weights: {', '.join(others)})",
                uncovered_layers=tuple(uncovered),
            )
        # The shards that hold an uncovered layer yet were left out, and why: what an operator looks at first.
        holders = sorted(f"{s.shard_id}: {why}" for s, why in left_out
                         if any(s.layer_lo <= layer <= s.layer_hi for layer in uncovered))
        raise RoutingError(
            "shard_unavailable",
            f"no healthy shard covers layers {layers} {of_model} (of {total_layers})"
            + (f"; left out: {'; '.join(holders)}" if holders else ""),
            uncovered_layers=tuple(uncovered),
        )


def _total_layers(shards: list[ShardCandidate]) -> int | None:
    return max((s.total_layers for s in shards), default=None)


def _covered_layer_count(shards: list[ShardCandidate], total_layers: int) -> int:
    return sum(1 for layer in range(total_layers) if any(s.layer_lo <= layer <= s.layer_hi for s in shards))
