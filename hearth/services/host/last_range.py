"""The layer range a `hearth host` last served of a model, kept in a file of its node's state: hosts restarted
together (a power cut) each see an empty mesh, and with it they take their old, disjoint ranges back at once
(planner.choose_range_remembering) rather than all choosing the same first range and spreading out one move at a
time."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hearth.events.envelope import Id, Label
from hearth.services.common.config import HearthSettings
from hearth.services.host.planner import LayerRange, fits_as_chosen
from hearth.services.shard.kept_events import shard_outbox_dir
from hearth.trust.keys import write_private_file

log = logging.getLogger(__name__)

LAST_RANGE_FOLDER = "host-last-range"
# A record is a few hundred bytes: a larger file is not one of ours, and is not read whole.
MAX_LAST_RANGE_FILE_BYTES = 4096
MAX_LAYERS = 100_000


class LastRange(BaseModel):
    """What a host served, and of what: the model, its weights and scheme, and the weights budget it chose within."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: Id
    weights_sha256: Id
    quantization: Label
    total_layers: int = Field(ge=1, le=MAX_LAYERS)
    weights_budget_bytes: int = Field(ge=0)
    layer_lo: int = Field(ge=0, lt=MAX_LAYERS)
    layer_hi: int = Field(ge=0, lt=MAX_LAYERS)

    def layers(self) -> LayerRange:
        return LayerRange(self.layer_lo, self.layer_hi)


def last_range_file(settings: HearthSettings, node: str, model_id: str) -> Path:
    """This node's file for `model_id`, in a folder beside the shard event outbox's (the state folder's, or the one
    `[shard] event_outbox_dir` names: a LocalCluster's work folder, so that one mesh's hosts never read another's).
    Named by a digest: node ids and model ids may hold any character."""
    name = hashlib.sha256(f"{node}\n{model_id}".encode()).hexdigest()[:32]
    return shard_outbox_dir(settings).with_name(LAST_RANGE_FOLDER) / f"{name}.json"


def remember_range(path: Path, served: LastRange) -> None:
    """Write `served` whole and synced (trust.keys.write_private_file: a file beside it renamed over it), so a power
    cut mid-write leaves the old record or the new one. A disk that refuses it costs only the preference at the next
    start: a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private_file(path, served.model_dump_json().encode())
    except OSError as error:
        log.warning("could not keep the range served (layers %s) in %s: %s", served.layers(), path, error)


def remembered_range(path: Path, *, node: str, model_id: str, weights_sha256: str, quantization: str,
                     layer_bytes: list[int], weights_budget: int) -> LayerRange | None:
    """The range `path` says this node's host last served, when it was of these weights in this scheme and is still a
    range the host could choose within `weights_budget` (planner.fits_as_chosen); None otherwise, with one INFO line
    saying why when there was a record."""
    try:
        with path.open("rb") as handle:
            text = handle.read(MAX_LAST_RANGE_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        log.info("host %s: the range it last served (%s) cannot be read, ignored: %s", node, path, error)
        return None
    try:
        if len(text) > MAX_LAST_RANGE_FILE_BYTES:
            raise ValueError(f"more than {MAX_LAST_RANGE_FILE_BYTES} bytes")
        last = LastRange.model_validate_json(text)
    except (ValueError, ValidationError) as error:
        log.info("host %s: the range it last served (%s) is not a record of one, ignored: %s", node, path,
                 (str(error).splitlines() or [repr(error)])[0])
        return None
    if (last.model_id, last.weights_sha256, last.quantization, last.total_layers) != (
            model_id, weights_sha256, quantization, len(layer_bytes)):
        log.info("host %s: it last served layers %s of other weights or in another scheme (%s), ignored", node,
                 last.layers(), last.quantization)
        return None
    if last.layer_hi < last.layer_lo or not fits_as_chosen(last.layers(), layer_bytes, weights_budget):
        log.info("host %s: it last served layers %s within %d bytes of weights; not the widest range that fits from "
                 "there within %d now, ignored", node, last.layers(), last.weights_budget_bytes, weights_budget)
        return None
    return last.layers()
