"""Building a runner or a head from a checkpoint: a meta-device skeleton, then only the needed tensors.

The whole ``*ForCausalLM`` is first instantiated on the meta device (no memory, public transformers
classes, so the layers are exactly the ones from_pretrained would build); then only the wanted modules
receive real tensors, read one by one from the safetensors files (or dequantized one by one from a GGUF file,
hearth/inference/gguf_checkpoint.py). Like ``from_pretrained``, tensors
that need no dtype conversion stay memory-mapped from the checkpoint files on the CPU: they become
resident when first used and are shared through the page cache by every process that maps the same
file, so a checkpoint must not be rewritten in place while it is being served. Tensors converted to
another dtype or sent to a GPU are written straight into their final tensor, a few MiB at a time, so
loading a range never needs more host memory than its weights plus one such chunk. A weight int4 rounds on the CPU is
read from the codes an earlier load kept on disk where they are (hearth/inference/int4_code_cache.py), not from the
checkpoint; on the CPU a weight rounded from floats is read a chunk of rows at a time (hearth/inference/layer_forms.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from .architectures import ArchitectureAdapter, adapter_for
from .devices import resolve_device
from .checkpoint import ModelInfo, SafetensorsCheckpoint, default_model_id, open_checkpoint, read_config, \
    read_config_dict, resolve_dtype, resolve_model_path
from .cpu_kernels import DEFAULT_CPU_LINEAR_KERNEL, use_cpu_linear_kernel
from .errors import CheckpointError, first_line
from .gguf_checkpoint import GGUFCheckpoint
from hearth.formats.gguf_support import is_gguf_file
from .gguf_tensor_table import check_layer_block_types
from .ollama_models import served_model_id
from .held_forms import held_scheme, stored_precision
from .int4_code_cache import Int4CodeCache, int4_code_cache, int4_code_cache_root
from .quantization import QuantizationScheme, QuantizedLinear, check_device_supports, \
    check_quantizable, dense_linears, quantize_linears
from .weight_codes import int4_codes_of_rows
from .layer_forms import HeldOtherwise, RoundedOnCPU, check_tensor_form, weight_rows
from .heap import bound_arena_tops
from .row_attention import use_row_attention
from .runner import LayerRangeRunner
from .stored_precision import resolved_scheme
from .sessions import EvictedSession

logger = logging.getLogger(__name__)


@dataclass
class _Skeleton:
    """A checkpoint opened for partial loading: config, adapter, and a model whose tensors live on meta."""

    info: ModelInfo
    config: PretrainedConfig
    adapter: ArchitectureAdapter
    model: nn.Module
    checkpoint: SafetensorsCheckpoint | GGUFCheckpoint
    module_names: dict[int, str]
    device: torch.device
    weights_from_code_cache: int = 0
    # The int4 code cache of the checkpoint by scheme label (rounded_on_cpu; None: none can be used).
    code_caches: dict[str, Int4CodeCache | None] = field(default_factory=dict)
    # Linears held otherwise than the scheme rounds them (held_otherwise), by the label of what they are held in.
    held_otherwise_labels: Counter[str] = field(default_factory=Counter)

    def name_of(self, module: nn.Module) -> str:
        return self.module_names[id(module)]

    def materialize(self, module: nn.Module, *, except_names: frozenset[str] = frozenset()) -> list[str]:
        """Read the module's parameters and persistent buffers from the checkpoint onto the skeleton's device, in
        its dtype (staged through host memory one bounded chunk at a time: SafetensorsCheckpoint.read), all but the
        checkpoint names in ``except_names`` (left on meta for the caller); returns the names read."""
        prefix = self.name_of(module) + "."
        local_names = [name for name in module.state_dict(keep_vars=True) if prefix + name not in except_names]
        checkpoint_names = [prefix + name for name in local_names]
        tensors = self.checkpoint.read(checkpoint_names, self.info.dtype, self.device)
        state = {local: tensors[prefix + local] for local in local_names}
        expected = module.state_dict(keep_vars=True)
        for local, tensor in state.items():
            check_tensor_form(prefix + local, tensor.shape, tensor.dtype, expected[local])
        module.load_state_dict(state, strict=not except_names, assign=True)
        module.requires_grad_(False)
        return checkpoint_names

    def held_otherwise(self, layer: nn.Module, scheme: QuantizationScheme) -> list[HeldOtherwise]:
        """The Linears of ``layer`` that hearth/inference/held_forms.py holds otherwise than ``scheme`` rounds them,
        each with the scheme it is held in (read from the checkpoint's header: no weight is read)."""
        linears = [(parent, child_name, linear, self.name_of(linear) + ".weight")
                   for parent, child_name, linear in dense_linears(layer)]
        stored_types = {weight_name: self.checkpoint.stored_type(weight_name) for *_, weight_name in linears}
        precision = stored_precision((weight_name, stored_types[weight_name], list(linear.weight.shape))
                                     for _, _, linear, weight_name in linears)
        return [HeldOtherwise(parent, child_name, linear, weight_name, held)
                for parent, child_name, linear, weight_name in linears
                if (held := held_scheme(scheme, stored_types[weight_name], tuple(linear.weight.shape), precision,
                                        self.device)) is not None]

    def rounded_on_cpu(self, layer: nn.Module, scheme: QuantizationScheme,
                       held_otherwise: list[HeldOtherwise]) -> list[RoundedOnCPU]:
        """The Linears of ``layer`` whose float weights int4 rounds on the CPU (none under another scheme or device),
        each with the cache of the checkpoint's codes (hearth/inference/int4_code_cache.py)."""
        if scheme.kind != "int4" or self.device.type != "cpu":
            return []
        if scheme.label not in self.code_caches:
            self.code_caches[scheme.label] = int4_code_cache(self.checkpoint.weight_files(), self.info.dtype,
                                                             scheme.label)
        held = {one.linear for one in held_otherwise}
        return [RoundedOnCPU(parent, child_name, linear, self.name_of(linear) + ".weight",
                             self.code_caches[scheme.label])
                for parent, child_name, linear in dense_linears(layer) if linear not in held]

    def materialize_layer(self, layer: nn.Module, scheme: QuantizationScheme) -> list[str]:
        """Materialize ``layer``, its Linears held otherwise than ``scheme`` rounds them (held_otherwise) already in
        that form: those stored as 4-bit codes in groups as QuantizedLinear from the stored codes (never read dense,
        nor re-rounded), a 4-bit mix's more precise ones held in int8; those int4 rounds on the CPU from their codes
        cached on disk, else rounded and their codes cached (rounded_on_cpu). On the CPU every Linear rounded from
        its float weight (int8, int4 without cached codes) is rounded from the checkpoint's rows a chunk at a time
        (weight_rows), so the layer is never held in floats; int8 codes are left for quantize_linears to pack.
        Returns the names of the checkpoint tensors the layer holds."""
        held_otherwise = self.held_otherwise(layer, scheme)
        as_stored = {one.weight_name for one in held_otherwise if one.held.kind == "int4"}
        rounded = self.rounded_on_cpu(layer, scheme, held_otherwise)
        cached = {one.weight_name: codes for one in rounded if one.cache is not None and (codes := one.cache.codes(
            one.weight_name, tuple(one.linear.weight.shape), scheme.group_size)) is not None}
        in_int8 = self.int8_of_rows(layer, scheme, held_otherwise)
        of_rows = in_int8 | {one.weight_name for one in rounded if one.weight_name not in cached}
        names = self.materialize(layer, except_names=frozenset(as_stored | set(cached) | of_rows))
        for one in held_otherwise:
            name = one.weight_name
            stored = self.checkpoint.read_stored_int4(name, self.device) if name in as_stored else None
            rows = self.weight_rows(one.linear, name) if name in of_rows else None
            setattr(one.parent, one.child_name, QuantizedLinear(one.linear, one.held, stored, rows, pack=False))
        self.held_otherwise_labels.update(one.held.label for one in held_otherwise)
        for one in rounded:
            codes = cached.get(one.weight_name)
            if codes is None:
                codes = int4_codes_of_rows(tuple(one.linear.weight.shape), scheme.group_size,
                                           self.weight_rows(one.linear, one.weight_name))
                if one.cache is not None:
                    one.cache.store(one.weight_name, codes)
            setattr(one.parent, one.child_name, QuantizedLinear(one.linear, scheme, codes))
        for parent, child_name, linear in dense_linears(layer):
            if (weight_name := self.name_of(linear) + ".weight") in in_int8:
                setattr(parent, child_name, QuantizedLinear(
                    linear, scheme, weight_rows=self.weight_rows(linear, weight_name), pack=False))
        self.weights_from_code_cache += len(cached)
        return [*as_stored, *cached, *of_rows, *names]

    def int8_of_rows(self, layer: nn.Module, scheme: QuantizationScheme,
                     held_otherwise: list[HeldOtherwise]) -> set[str]:
        """The weights of ``layer``'s Linears held in int8 on the CPU (by the scheme, or held_otherwise), which
        QuantizedLinear rounds from the checkpoint's rows (weight_rows); none elsewhere."""
        if self.device.type != "cpu":
            return set()
        held = {one.linear for one in held_otherwise}
        return {one.weight_name for one in held_otherwise if one.held.kind == "int8"} | (
            {self.name_of(linear) + ".weight" for *_, linear in dense_linears(layer) if linear not in held}
            if scheme.kind == "int8" else set())

    def weight_rows(self, linear: nn.Linear, weight_name: str) -> Iterator[torch.Tensor]:
        """The Linear's weight read a chunk of rows at a time in the skeleton's dtype (layer_forms.weight_rows)."""
        return weight_rows(self.checkpoint, linear, weight_name, self.info.dtype)


def open_skeleton(
    model: str | Path,
    *,
    dtype: torch.dtype | str | None,
    device: torch.device | str | None,
    attn_implementation: str | None,
    model_id: str | None,
    revision: str | None,
    cache_dir: str | Path | None,
    local_files_only: bool | None,
) -> _Skeleton:
    path = resolve_model_path(
        model, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    raw_config = read_config_dict(path)
    # Refuse unsupported families from config.json alone: before transformers parses it, before any weight.
    adapter = adapter_for(_RawConfigView(raw_config))
    config = read_config(path)
    compute_device = resolve_device(device if device is not None else "cpu")
    compute_dtype = resolve_dtype(dtype, getattr(config, "dtype", None))
    skeleton_kwargs = {"dtype": compute_dtype}
    if attn_implementation is not None:
        skeleton_kwargs["attn_implementation"] = attn_implementation
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, **skeleton_kwargs)
    except Exception as exc:  # a head count of 0, sizes that do not divide: transformers raises many kinds
        raise CheckpointError(f"{path.name}'s config does not describe a model transformers can build: "
                              f"{first_line(exc)}") from None
    skeleton.eval()
    config = skeleton.config
    checkpoint = open_checkpoint(path, skeleton)
    if isinstance(model, Path) or Path(str(model)).expanduser().exists():
        default_id = default_model_id(path)
    else:
        default_id = served_model_id(str(model))
    info = ModelInfo(
        model_id=model_id or default_id,
        path=path,
        architecture=adapter.architecture,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        dtype=compute_dtype,
        tie_word_embeddings=bool(getattr(config.get_text_config(), "tie_word_embeddings", False)),
        max_positions=getattr(config.get_text_config(), "max_position_embeddings", None) or None,
    )
    module_names = {id(module): name for name, module in skeleton.named_modules()}
    return _Skeleton(info, config, adapter, skeleton, checkpoint, module_names, compute_device)


class _RawConfigView:
    """Just enough of config.json for adapter lookup, without asking transformers to parse it."""

    def __init__(self, raw: dict):
        self.model_type = raw.get("model_type")
        self.architectures = raw.get("architectures")


def check_checkpoint(path: Path) -> None:
    """Refuse, reading no weight, a resolved checkpoint whose config (config.json, a GGUF's metadata) does not read
    or names a family hearth does not serve, a folder without readable safetensors headers, or a GGUF with a layer in
    a block type hearth does not read: CheckpointError or UnsupportedArchitectureError."""
    try:
        raw_config = read_config_dict(path)
    except (OSError, ValueError) as error:  # unreadable, or not JSON
        raise CheckpointError(f"{path.name}: its config does not read ({first_line(error)})") from None
    if not isinstance(raw_config, dict):
        raise CheckpointError(f"{path.name}: its config.json is not a JSON object")
    adapter_for(_RawConfigView(raw_config))
    if is_gguf_file(path):
        check_layer_block_types(path)
    else:
        SafetensorsCheckpoint(path)


def assert_materialized(module: nn.Module, what: str) -> None:
    leftovers = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftovers:
        raise CheckpointError(f"{what}: tensors {leftovers} were not loaded")


def load_layer_range(
    model: str | Path,
    lo: int,
    hi: int,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    cache_budget_bytes: int,
    session_ttl_s: float,
    model_id: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool | None = None,
    on_evict: Callable[[EvictedSession], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    static_cache_tokens: int | None = None,
    cpu_linear_kernel: str = DEFAULT_CPU_LINEAR_KERNEL,
    quantization: str | QuantizationScheme = "none",
    prefix_ttl_s: float | None = None,
) -> LayerRangeRunner:
    """A runner holding decoder layers ``lo..hi`` (inclusive) of ``model`` and nothing else.

    ``model`` is a checkpoint folder, a hub id, or a GGUF file (or a folder holding one; its id defaults to the
    file's stem). ``dtype`` None/"auto" uses the checkpoint's dtype.
    ``device`` (None: the CPU) is where the weights are read to and the layers run (inference.devices).
    ``cache_budget_bytes`` and ``session_ttl_s`` bound the sessions' KV caches (LayerRangeRunner); they have no
    default here, their one home is the configuration's [shard] kv_cache_budget_mb and eviction_idle_s.
    ``static_cache_tokens``: sessions get static KV caches of that many positions and, on a GPU, decode steps replay
    CUDA graphs (hearth/inference/static_decode.py; full-attention SDPA architectures only, others stay dynamic).
    ``prefix_ttl_s``: ended sessions' KV may be kept as prefixes for that long unused (None: none kept;
    hearth/inference/prefix_cache.py).
    ``attn_implementation`` None picks transformers' default for the family (sdpa, or eager for Gemma 2).
    ``cpu_linear_kernel``: which kernel float32 CPU layers' projections run on (hearth/inference/cpu_kernels.py).
    ``quantization`` ("none", "int8", "int4/g64", ...; "auto": hearth/inference/stored_precision.py): each layer's
    Linears are quantized as soon as the layer is read, before the next one is (hearth/inference/quantization.py), so
    the host never holds the range at full precision; quantized Linears run torch's quantized kernels whatever
    ``cpu_linear_kernel`` says.
    Only the tensors of layers lo..hi are read from the (single-file or sharded) safetensors files, or the GGUF
    (each dequantized to ``dtype``, then quantized to ``quantization``: hearth/inference/gguf_checkpoint.py; but a
    Linear weight stored as 4-bit codes in groups (Q4_0, Q4_1, Q4_K) is never re-rounded into more bits: under int8 or
    int4 of its group it is held as stored, in int4 of its groups; ``runner.quantization`` stays the scheme asked,
    auto resolved).
    """
    skeleton = open_skeleton(
        model,
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
        model_id=model_id,
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
    )
    num_layers = skeleton.info.num_layers
    if not (0 <= lo <= hi < num_layers):
        raise ValueError(
            f"layer range {lo}-{hi} is not inside 0-{num_layers - 1} of {skeleton.info.model_id}"
        )
    use_row_attention(skeleton.model, skeleton.device)
    decoder = skeleton.model.get_decoder()
    scheme = resolved_scheme(quantization, skeleton.info.path, skeleton.device)
    check_device_supports(scheme, skeleton.device)
    for layer_index in range(lo, hi + 1):
        layer = decoder.layers[layer_index]
        check_quantizable(layer, scheme, f"layer {layer_index} of {skeleton.info.model_id}",
                          held_otherwise={one.linear for one in skeleton.held_otherwise(layer, scheme)})
    layers: dict[int, nn.Module] = {}
    loaded_names: list[str] = []
    for layer_index in range(lo, hi + 1):
        layer = decoder.layers[layer_index]
        loaded = skeleton.materialize_layer(layer, scheme)
        loaded_names += loaded
        assert_materialized(layer, f"layer {layer_index}")
        quantize_linears(layer, scheme)
        layers[layer_index] = layer
    if skeleton.held_otherwise_labels:
        said = [f"{count} Linears held in {label} " + ("as stored" if label.startswith("int4") else
                                                        "(a 4-bit mix's more precise weights)")
                for label, count in sorted(skeleton.held_otherwise_labels.items())]
        logger.info("layers %d-%d of %s under %s: %s", lo, hi, skeleton.info.model_id, scheme.label, ", ".join(said))
    use_cpu_linear_kernel(layers.values(), cpu_linear_kernel, skeleton.device,
                          next(layers[lo].parameters()).dtype)
    if skeleton.device.type == "cpu":  # only once the weights are in (heap.bound_arena_tops says why)
        bound_arena_tops()
    # The rotary module only holds inverse frequencies derived from the config: build it for real.
    rotary_embedding = type(decoder.rotary_emb)(config=skeleton.config).to(skeleton.device)
    logger.info(
        "loaded layers %d-%d of %s (%d bytes read, quantization %s%s)",
        lo,
        hi,
        skeleton.info.model_id,
        skeleton.checkpoint.bytes_read,
        scheme.label,
        f", {skeleton.weights_from_code_cache} weights' codes from the cache {int4_code_cache_root()}"
        if skeleton.weights_from_code_cache else "",
    )
    runner = LayerRangeRunner(
        info=skeleton.info,
        config=skeleton.config,
        adapter=skeleton.adapter,
        layers=layers,
        rotary_embedding=rotary_embedding,
        loaded_tensor_names=tuple(loaded_names),
        layer_name_prefix=skeleton.name_of(decoder.layers) + ".",
        checkpoint_bytes_read=skeleton.checkpoint.bytes_read,
        device=skeleton.device,
        cache_budget_bytes=cache_budget_bytes,
        session_ttl_s=session_ttl_s,
        clock=clock,
        on_evict=on_evict,
        static_cache_tokens=static_cache_tokens,
        prefix_ttl_s=prefix_ttl_s,
    )
    runner.quantization = scheme.label
    return runner
