"""Every event string and list is bounded: an over-long id is refused, an over-long reason is cut, and an event with
every field at its limit still fits the streams' max_msg_size, so no event can fill the log or a read model."""

from __future__ import annotations

import math
import typing

import pytest
from pydantic import BaseModel, ValidationError

from hearth.events.envelope import max_event_hops, max_event_number, max_label_chars
from hearth.events.models import (
    EVENT_CLASSES,
    IntegrityMismatchConfirmed,
    PipelineCompleted,
    PipelineFailover,
    ShardAdvertised,
    ShardWithdrawn,
    encode_event,
    max_model_layers,
)
from hearth.protocol.bounds import max_id_chars, max_reason_chars, max_shard_id_chars
from hearth.events.streams import STREAM_SPECS, event_max_msg_bytes
from hearth.inference.activation_compare import largest_reported_error, reportable_error
from tests.readmodel_helpers import advertised

# A character JSON writes as six bytes (\u0000): the worst a string of n characters can cost.
worst_char = "\x00"


def schema_nodes(schema: dict):
    """Every property schema, followed through $defs, anyOf and items."""
    defs = schema.get("$defs", {})
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "$ref" in node:
                stack.append(defs[node["$ref"].rsplit("/", 1)[-1]])
            yield node
            stack.extend(value for key, value in node.items() if key != "$defs")
        elif isinstance(node, list):
            stack.extend(node)


@pytest.mark.parametrize("event_class", EVENT_CLASSES, ids=lambda cls: cls.__name__)
def test_every_string_and_list_of_every_event_has_a_maximum(event_class):
    for node in schema_nodes(event_class.model_json_schema()):
        # A constant, an enumeration or a date-time is bounded by what it may be.
        if node.get("type") == "string" and not {"const", "enum", "format"} & set(node):
            assert "maxLength" in node, (event_class.__name__, node)
        if node.get("type") == "array":
            assert "maxItems" in node, (event_class.__name__, node)


def test_an_over_long_id_is_refused_and_an_over_long_reason_is_cut():
    with pytest.raises(ValidationError, match="shard_id"):
        ShardWithdrawn(node_id="n", shard_id="s" * (max_shard_id_chars + 1), reason="stop")
    with pytest.raises(ValidationError, match="finish_reason"):
        PipelineCompleted(node_id="n", pipeline_id="p-1", prompt_tokens=1, completion_tokens=1, duration_ms=1,
                          tokens_per_second=1, finish_reason="x" * 7_000_000)
    withdrawn = ShardWithdrawn(node_id="n", shard_id="s", reason="r" * 7_000_000)
    assert len(withdrawn.reason) == max_reason_chars
    with pytest.raises(ValidationError, match="replacement_hops"):
        PipelineFailover(node_id="n", pipeline_id="p-1", failed_shard_id="s", replacement_hops=["h"] * 65,
                         reason="gone", resumed_at_token=0)


@pytest.mark.parametrize("lo, hi, total", [(3, 2, 8), (0, 8, 8), (0, 3, max_model_layers + 1)],
                         ids=["backwards", "past-the-last-layer", "more-layers-than-any-model"])
def test_an_advertised_range_that_is_no_range_of_a_model_is_refused(lo, hi, total):
    """Such a range divided routing's per-layer costs by zero, or made it walk 2^40 layers on its event loop."""
    with pytest.raises(ValidationError, match="no range of a model"):
        advertised(lo, hi, "n", total=total)
    advertised(0, total - 1 if total <= max_model_layers else 3, "n", total=min(total, max_model_layers))


def largest(event_class: type[BaseModel]) -> BaseModel:
    """An instance of `event_class` with every string and list at its limit, in the costliest characters."""
    values = {}
    for name, field in event_class.model_fields.items():
        if name in ("type", "version", "occurred_at"):
            continue
        limit = next((bound.max_length for bound in field.metadata if hasattr(bound, "max_length")), None)
        annotation = field.annotation
        if name == "evidence_sha256":
            values[name] = "0" * limit  # a digest: hex digits only
            continue
        if name in ("member", "public_key", "new_public_key"):  # names and nkeys: plain letters, by their patterns
            values[name] = "U" + "A" * (limit - 1)
            continue
        if name in ("layer_lo", "layer_hi", "total_layers"):  # a range of the largest model an event names
            values[name] = max_model_layers - (name != "total_layers")
            continue
        if name == "pipeline_id":
            values[name] = "p" * 128
        elif name == "event_id":
            values[name] = "e" * 64
        elif typing.get_origin(annotation) is list:
            item, = typing.get_args(annotation)
            items = limit or max_event_hops
            values[name] = ([largest(item)] * items if isinstance(item, type) and issubclass(item, BaseModel)
                            else [worst_char * max_shard_id_chars] * items)
        elif annotation is str:
            values[name] = worst_char * (limit or max_id_chars)
        elif typing.get_origin(annotation) is typing.Literal:
            values[name] = typing.get_args(annotation)[0]
        elif annotation is int:
            values[name] = max_event_number
        elif annotation is float:  # just below its bound: the most digits a float within it takes
            bound = next((b.le for b in field.metadata if getattr(b, "le", None) is not None), max_event_number)
            values[name] = math.nextafter(float(bound), 0.0)
    return event_class(**values)


@pytest.mark.parametrize("event_class", EVENT_CLASSES, ids=lambda cls: cls.__name__)
def test_the_largest_possible_event_fits_the_streams_max_msg_size(event_class):
    size = len(encode_event(largest(event_class)))
    # Room for what signing adds to every event (a public key and a signature, a few hundred bytes).
    assert size < event_max_msg_bytes - 4096, (event_class.__name__, size)
    assert all(spec.max_msg_bytes == event_max_msg_bytes for spec in STREAM_SPECS)


def test_the_limits_are_those_of_the_docs():
    advertised = ShardAdvertised.model_json_schema()["properties"]
    assert advertised["model_id"]["maxLength"] == max_id_chars
    assert advertised["dtype"]["maxLength"] == max_label_chars
    assert advertised["shard_id"]["maxLength"] == max_shard_id_chars


@pytest.mark.parametrize("error", [math.inf, math.nan, 1e30, 3e12])
def test_a_relative_error_however_large_is_reported_within_what_an_event_carries(error):
    # A bitflip made errors of 1e30: the mismatch event did not validate, and the liar was never recorded.
    event = IntegrityMismatchConfirmed(
        pipeline_id="p", node_id="hub", shard_id="m:0-1@x", witnesses=["m:0-1@y", "m:0-1@z"], layer_lo=0, layer_hi=1,
        quantization="none", dtype="float32", position=0, step_kind="prefill", relative_error=reportable_error(error),
        tolerance=1e-4, evidence_sha256="0" * 64)
    assert event.relative_error == largest_reported_error
