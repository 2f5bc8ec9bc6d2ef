"""RunContext: what every call of one orchestrator shares (its connection, settings, router, event outbox, head
batcher, live routing room), handed to each call's PipelineRun by the service."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient

from hearth.events.outbox import EventOutbox
from hearth.readmodels.runner import Projector
from hearth.readmodels.scratch_model import ScratchReadModel
from hearth.services.common.config import HearthSettings
from hearth.services.orchestrator.answer_kv import AnswerWarmUps
from hearth.services.orchestrator.canaries import CanaryLibrary
from hearth.services.orchestrator.capacity import ShardLoad
from hearth.services.orchestrator.guards import RangeGuards
from hearth.services.orchestrator.catalog import ModelCatalog
from hearth.services.orchestrator.head_batcher import HeadSteps
from hearth.services.orchestrator.health import RecentFailures
from hearth.services.orchestrator.hop_owner import OpenSigner
from hearth.services.orchestrator.kept_inputs import KeptInputs
from hearth.services.orchestrator.prefix import KeptChains
from hearth.services.orchestrator.router import ShardRouter
from hearth.services.transport.integrity import NormBounds


@dataclass
class RunContext:
    """What every call of one orchestrator shares."""

    nc: NatsClient
    node_id: str
    settings: HearthSettings
    router: ShardRouter
    # The routing read model: a --db file's projector, or the scratch one rebuilt when found damaged.
    projector: Projector | ScratchReadModel
    catalog: ModelCatalog
    outbox: EventOutbox
    recent_failures: RecentFailures
    # Every call's per-token head work, batched across the calls decoding at once.
    head_steps: HeadSteps
    # Per model: bounds of the activations that reach us (the sink's integrity check), shared by all calls.
    sink_bounds: dict[str, NormBounds]
    # The streams this orchestrator holds on each shard and the shards that just refused it (live routing room).
    load: ShardLoad
    # Per layer range: the norms of outputs a check confirmed (hearth/services/orchestrator/guards.py).
    guards: RangeGuards
    # Confirmed work kept for replay to other hosts (hearth/services/orchestrator/canaries.py).
    canaries: CanaryLibrary
    running_calls: int = 0
    # Seals and signs our `open`s on a community mesh (hop_owner.py; set by the service); None: unsigned, keys in clear.
    open_signer: OpenSigner | None = None
    # Which of our chains kept which blocks of their calls (hearth/services/orchestrator/prefix.py), for routing.
    kept_chains: KeptChains = field(default_factory=KeptChains)
    # What entered each hop over kept prefixes, so hops that begin from them can be checked (set by the service).
    kept_inputs: KeptInputs = field(default_factory=lambda: KeptInputs(0))
    # The answers of calls that ended well being prefilled again for their hops to keep (answer_kv.py).
    warm_ups: AnswerWarmUps = field(default_factory=AnswerWarmUps)
    # Per model: the token ids of each public system prompt alone (encoded once).
    public_prompt_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    # Shards a check of ours proved wrong: out of every chain at once, until the read model says so too.
    quarantined: set[str] = field(default_factory=set)
    # Every shard a check of ours proved wrong, in the order proved: a call running then withdraws its unconfirmed
    # work there (verification.py), even once routing has handed that quarantine over to the read model.
    proved_wrong: list[str] = field(default_factory=list)

    def prove_wrong(self, shard_id: str) -> None:
        """A check of ours proved `shard_id` wrong: out of routing at once, and refuted in every running call."""
        self.quarantined.add(shard_id)
        self.proved_wrong.append(shard_id)
