"""What `hearth host` knows of a model before choosing its layers, with no layer fetched: how many layers, the bytes
each takes as this host would hold it, the weights digest and the id it is served under.

A local folder or GGUF file (or a hub id whose snapshot is complete in the hub cache) is read from disk; a
`store:NAME` model from the community store's manifest (hearth/services/weights_store.py); any other hub id from the
hub's listing, config.json and safetensors headers, or a hub GGUF's header read by byte ranges
(hearth/inference/hub_fetch.hub_layout; `org/name:FILE.gguf` names one GGUF of a repository holding several). Loading
the chosen range then fetches only that range (hearth/services/shard/main.load_shard).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.inference import read_config_dict, resolve_model_path, weights_sha256
from hearth.inference.checkpoint import default_model_id, is_local_model
from hearth.inference.errors import CheckpointError
from hearth.inference.gguf_checkpoint import default_read_device
from hearth.formats.gguf_support import is_gguf_file
from hearth.inference.gguf_tensor_table import check_layer_block_types
from hearth.inference.hub_cache import complete_hub_snapshot, hub_cache_gguf
from hearth.inference.hub_fetch import hub_layout
from hearth.inference.memory import layer_tensor_specs, layer_weight_bytes_of
from hearth.inference.ollama_models import served_model_id
from hearth.inference.quantization import QuantizationScheme
from hearth.services.common.config import HearthSettings
from hearth.services.shard.main import resolve_quantization
from hearth.services.weights_store import read_manifest, refusals_told, store_model_name


@dataclass(frozen=True)
class ModelLayout:
    """A model as `hearth host` plans with it."""

    total_layers: int
    # Bytes of each decoder layer (index = layer) in the compute dtype under the quantization scheme.
    layer_bytes: list[int]
    weights_sha256: str
    served_id: str
    # What the host's --quantize setting serves this model in (auto resolved from its stored types).
    scheme: QuantizationScheme


async def model_layout(model: str, *, model_id: str | None, compute_dtype: torch.dtype,
                       quantize: str | QuantizationScheme,
                       nats_url: str | None, settings: HearthSettings,
                       device: torch.device | str = default_read_device) -> ModelLayout:
    """The ModelLayout of `model` (a folder, GGUF file, hub id or `store:NAME`) as `device` will hold it under the
    `quantize` setting (hearth/services/shard/main.quantize_setting's); CheckpointError or WeightsStoreError (one
    line) when it cannot be read, ShardInputRefused when `device` has no kernel for the scheme."""
    if (name := store_model_name(model)) is not None:
        manifest = await _store_manifest(name, nats_url, settings)
        scheme = resolve_quantization(quantize, manifest.layer_tensor_specs(), device)
        return ModelLayout(manifest.num_layers, manifest.layer_weight_bytes(compute_dtype, scheme, device),
                           manifest.weights_sha256, model_id or name, scheme)
    local = await asyncio.to_thread(local_checkpoint, model)
    if local is None:
        layout = await asyncio.to_thread(hub_layout, model)
        total = int(layout.config["num_hidden_layers"])
        scheme = resolve_quantization(quantize, layout.tensors, device)
        per_layer = layer_weight_bytes_of(layout.tensors, compute_dtype, scheme, device=device)
        return ModelLayout(total, each_layers_bytes(model, total, per_layer), layout.weights_sha256,
                           model_id or model, scheme)
    total = int(read_config_dict(local)["num_hidden_layers"])
    if is_gguf_file(local):  # refused while planning, not once a range is announced and loading it fails
        await asyncio.to_thread(check_layer_block_types, local)
    tensors = await asyncio.to_thread(layer_tensor_specs, local)  # headers only, read once for both
    scheme = resolve_quantization(quantize, tensors, device)
    per_layer = layer_weight_bytes_of(tensors, compute_dtype, scheme, device=device)
    digest = await asyncio.to_thread(weights_sha256, local)
    served_id = model_id or (default_model_id(local) if Path(model).expanduser().exists()
                             else served_model_id(model))
    return ModelLayout(total, each_layers_bytes(model, total, per_layer), digest, served_id, scheme)


def each_layers_bytes(model: str, total: int, per_layer: dict[int, int]) -> list[int]:
    """Each of the `total` layers' bytes; CheckpointError when `model` holds no weights of some of them (an incomplete
    checkpoint: a layer that seemed to weigh nothing would be taken on for free, and then fail to load)."""
    missing = [index for index in range(total) if not per_layer.get(index)]
    if missing:
        raise CheckpointError(f"{model} holds no weights of layer {missing[0]} ({len(missing)} of its {total} layers "
                              "have none): an incomplete checkpoint, download or convert it again")
    return [per_layer[index] for index in range(total)]


def local_checkpoint(model: str) -> Path | None:
    """The folder or GGUF file of `model` on this disk (a hub id: its complete snapshot, or its GGUF in the hub
    cache), None for a hub id to read from the hub."""
    if is_local_model(model):  # a link leading nowhere too: this machine's, not a hub id
        return resolve_model_path(model)  # CheckpointError for a path that is not a checkpoint
    return complete_hub_snapshot(model, None, None) or hub_cache_gguf(model, None, None)


async def _store_manifest(name: str, nats_url: str | None, settings: HearthSettings):
    from hearth.services.broker.connection import close_quietly, connect_nats

    nc = await connect_nats(nats_url, name=f"hearth host {name}", settings=settings.nats)
    try:
        return await refusals_told(nc, read_manifest(nc.jetstream(), name))
    finally:
        await close_quietly(nc, settings.nats.close_timeout_s)
