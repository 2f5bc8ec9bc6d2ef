"""The checks of `hearth doctor` about `--model`: that it names a checkpoint folder or a GGUF file hearth serves (a
hub id in the hub cache is checked there; a `store:NAME` on the broker, broker_checks.py), and that the memory budget
of a shard host holds at least one of its layers as `hearth host` plans it. Nothing is downloaded, and no cache is
written: a GGUF is read by its header and its metadata, not through the GGUF cache the serving commands fill."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hearth.services.common.config import HearthSettings
from hearth.services.doctor.report import CheckResult, fail, ok, warn

BUDGET_FIX = ("give a larger --memory-budget-mb ([shard] max_memory_mb), a smaller [shard] kv_cache_budget_mb, or "
              "--quantize int8 (int4)")
HUB_FIX = ("fetch it beforehand where the hub can be reached (its layers then come from the hub cache), or publish "
           "it to the community's store: hearth weights publish")


@dataclass(frozen=True)
class LocalModel:
    """A model found on this machine: its resolved path, its layer count, and, for a GGUF, its checked header."""

    path: Path
    total_layers: int
    gguf_header: object | None = None


@dataclass(frozen=True)
class ModelSource:
    """What `--model` names: a model of this machine, a `store:NAME` to read from the broker, or neither (a hub id
    that is not in the hub cache, or a model that failed its check)."""

    model: str
    local: LocalModel | None = None
    store_name: str | None = None


def model_source_check(model: str) -> tuple[CheckResult | None, ModelSource]:
    """Whether `model` (as `--model` takes it) names a model hearth serves, read from this machine only; no line for a
    `store:NAME`, which the broker's checks read."""
    from hearth.inference.errors import InferenceError, first_line
    from hearth.services.common.hearth_files import bundled_model_or
    from hearth.services.host.model_layout import local_checkpoint
    from hearth.services.weights_store import WeightsStoreError, store_model_name

    model = bundled_model_or(model)
    try:
        store_name = store_model_name(model)
        if store_name is not None:
            return None, ModelSource(model, store_name=store_name)
        path = local_checkpoint(model)
        if path is None:
            return warn("model", f"{model} is not on this machine: a hub id, read from the hub when the command "
                                 "starts (the layers it serves only)", HUB_FIX), ModelSource(model)
        local = checked_local_model(path)
    except (InferenceError, WeightsStoreError, ValueError, KeyError, OSError) as error:
        return fail("model", f"{model}: {first_line(error)}"), ModelSource(model)
    kind = "GGUF file" if local.gguf_header is not None else "checkpoint folder"
    return ok("model", f"{local.path}: a {kind} of {local.total_layers} layers hearth serves"), \
        ModelSource(model, local=local)


def checked_local_model(path: Path) -> LocalModel:
    """The model at `path` (resolved: a folder or a GGUF file) as the serving commands check it at start, reading no
    weight; CheckpointError or UnsupportedArchitectureError when hearth does not serve it."""
    from hearth.formats.gguf_support import is_gguf_file
    from hearth.inference.checkpoint import read_config_dict
    from hearth.inference.gguf_checkpoint import parsed_gguf_config
    from hearth.inference.gguf_header import checked_gguf_header
    from hearth.inference.gguf_layout import check_block_types
    from hearth.inference.loading import check_checkpoint

    if not is_gguf_file(path):
        check_checkpoint(path)
        return LocalModel(path, int(read_config_dict(path)["num_hidden_layers"]))
    header = checked_gguf_header(path)
    check_block_types(((tensor.name, tensor.block_type) for tensor in header.split.tensors
                       if tensor.layer is not None), path.name)
    config = parsed_gguf_config(path)
    return LocalModel(path, int(config["num_hidden_layers"]), header)


def memory_check(source: ModelSource, manifest, settings: HearthSettings, *, memory_budget_mb: float | None,
                 device: str | None, dtype: str | None, quantize: str | None) -> CheckResult | None:
    """Whether a shard host's budget (`--memory-budget-mb`, else [shard] max_memory_mb; at most what the device has
    free) holds at least one layer of the model, weights as `--quantize` holds them plus the KV reserve, as
    `hearth host` plans; None when the model's layers could not be weighed here (a hub id, a model that failed)."""
    from hearth.inference.devices import MiB, device_memory_available_bytes
    from hearth.inference.errors import InferenceError, first_line
    from hearth.inference.memory import shown_mb
    from hearth.services.host.main import budget_refusal, with_memory_budget
    from hearth.services.host.planner import widest_fit
    from hearth.protocol.quantization_labels import AUTO_QUANTIZATION
    from hearth.services.shard.main import ShardInputRefused, quantize_setting, resolve_compute, resolve_quantization
    from hearth.services.shard.memory_plan import kv_reserve_bytes
    from hearth.services.weights_store import WeightsStoreError

    if source.local is None and manifest is None:
        return None
    host = settings.research.distributed_inference.host
    try:
        compute_device, compute_dtype = resolve_compute(device, dtype, host)
        setting = quantize_setting(quantize, host, compute_device)
    except ShardInputRefused as error:
        return fail("memory", str(error))
    try:
        tensors = _layer_tensors(source, manifest)
        scheme = resolve_quantization(setting, tensors, compute_device)
        layer_bytes = _layer_bytes(source, manifest, compute_dtype, scheme, compute_device)
    except ShardInputRefused as error:
        return fail("memory", str(error))
    except (InferenceError, WeightsStoreError, ValueError, KeyError, OSError) as error:
        return fail("memory", f"the layers of {source.model} cannot be weighed: {first_line(error)}")
    shard = with_memory_budget(settings, memory_budget_mb).shard
    budget_bytes = int(shard.max_memory_mb * MiB)
    available = device_memory_available_bytes(compute_device)
    limited = available is not None and available < budget_bytes
    if limited:
        budget_bytes = available
    where = f" (what {compute_device} has free now, less than the budget of {shard.max_memory_mb:g} MB)" \
        if limited else ""
    why = budget_refusal(layer_bytes, budget_bytes, shard, source.model)
    if why is not None:
        return fail("memory", why + where, BUDGET_FIX)
    weights_budget = budget_bytes - kv_reserve_bytes(shard)
    most = max(hi - lo + 1 for lo in range(len(layer_bytes))
               if (hi := widest_fit(lo, layer_bytes, weights_budget)) is not None)
    held = (f"quantized {scheme.label}" if scheme.quantized else "unquantized") + \
        (" (--quantize auto: the precision its layers are stored in)" if setting == AUTO_QUANTIZATION else "")
    return ok("memory", f"{shown_mb(budget_bytes)} MB{where} holds up to {most} of the {len(layer_bytes)} layers, "
                        f"{held}, on {compute_device} ({shown_mb(kv_reserve_bytes(shard))} MB of it the KV reserve)"
                        f"{_rounded_again_note(tensors, scheme, compute_device)}")


def _rounded_again_note(tensors, scheme, device) -> str:
    """What the memory line adds where int4 rounds a GGUF's quantized blocks again (an I-quant, Q2_K, Q3_K: no
    kernel holds their levels), which costs quality on top of the file's own and saves no memory over a 4-bit file
    held as stored; empty otherwise."""
    from hearth.inference.memory import rounded_again_of

    again = rounded_again_of(tensors, scheme, device=device) if scheme.kind == "int4" else {}
    if not again:
        return ""
    return (f"; its {', '.join(again)} blocks are rounded again into {scheme.label} (no kernel holds them as "
            "stored): `hearth eval --reference` measures what that costs, and a Q4_K_M file of the model is served "
            "as stored")


def _layer_tensors(source: ModelSource, manifest) -> list[tuple[str, str, list[int]]]:
    """Each layer tensor's (name, stored type, shape): from the store's manifest, a folder's safetensors headers or
    a GGUF's header (what hearth/inference/memory.py counts)."""
    from hearth.inference.gguf_tensor_table import header_layer_tensors
    from hearth.inference.memory import layer_tensor_specs

    if manifest is not None:
        return manifest.layer_tensor_specs()
    local = source.local
    assert local is not None
    if local.gguf_header is None:
        return layer_tensor_specs(local.path)
    return header_layer_tensors(local.gguf_header.split.tensors)


def _layer_bytes(source: ModelSource, manifest, compute_dtype, scheme, device) -> list[int]:
    """Each layer's bytes as the device holds them (_layer_tensors' tensors, counted by
    hearth/inference/memory.py)."""
    from hearth.inference.memory import layer_weight_bytes_of
    from hearth.services.host.model_layout import each_layers_bytes

    if manifest is not None:
        return manifest.layer_weight_bytes(compute_dtype, scheme, device)
    local = source.local
    assert local is not None
    per_layer = layer_weight_bytes_of(_layer_tensors(source, None), compute_dtype, scheme, device=device)
    return each_layers_bytes(source.model, local.total_layers, per_layer)
