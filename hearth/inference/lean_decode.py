"""LeanDecoder: a one-token step through Llama-style decoder layers (Llama, Mistral, Qwen2 on full attention)
computed operation for operation as transformers' modules compute it, without their call machinery; used only where
checked steps came out bitwise equal to theirs.

Why: a decode step of one token is small products and dozens of tiny operations per layer, and on a CPU the Python
around them (module calls, keyword plumbing, the mask builder, a shared int8 product looked up member by member)
costs a shard about as much as its int8 products (BENCHMARKS.md, "Quantized shard kernels"). Here a layer is the
same operations called directly, with two rewrites that change no bit:
- the Linears that read one input and run on one shared int8 product (q, k and v; gate and up:
  hearth/inference/shared_products.py) take their columns from one call of it;
- the rotary embedding runs on the queries and keys together, as ``x * cos + roll(x) * signed_sin``: rolling each
  head by half its width and negating the first half of ``sin`` is exactly transformers' ``rotate_half(x) * sin``
  (a product's sign is its factors' signs, its magnitude theirs).
Attention is transformers' own SDPA function, under the mask a one-token step gets (none: a single query sees every
cached key). Because a transformers release could change a layer's arithmetic, `verified_lean_decoder` runs a few
steps both ways on scratch caches before a runner's first one-token step (`LeanSlot`: loading allocates nothing for
it) and keeps the lean path only if every output and cached key and value is bitwise equal. A batched step whose
rows are one token each, each row attending its own cache (hearth/inference/batched.py on a CPU), runs here too: the
products and norms take every row at once, exactly as in the modules' batched step. Anything else (other families,
sliding windows, steps of several tokens) runs through transformers' modules as before.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .architectures import FULL_ATTENTION
from .row_attention import SDPA_IMPLEMENTATIONS
from .shared_products import SharedRowProduct

logger = logging.getLogger(__name__)

# model_types whose decoder layers are Llama's (norm, attention with rotary embedding, gated MLP, two residuals).
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Positions prefilled on the scratch caches before the checked one-token steps, and how many such steps.
_CHECK_PREFILL_TOKENS = 2
_CHECK_STEPS = 2


@dataclass(frozen=True)
class RotaryFactors:
    """A one-token step's rotary factors, ``[B, 1, head_dim]`` (a row per session): cos, and sin with its first half
    negated."""

    cos: torch.Tensor
    signed_sin: torch.Tensor


class LeanDecoder:
    """One-token steps of layers ``layers`` (index -> transformers decoder layer) over a DynamicCache."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        self._layers = layers
        # Per layer, the shared products its q, k and v, and its gate and up, run on (None: each Linear on its own).
        self._shared = {index: (_shared_by((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                                _shared_by((layer.mlp.gate_proj, layer.mlp.up_proj)))
                        for index, layer in layers.items()}

    @staticmethod
    def factors(position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> RotaryFactors:
        """The rotary factors of a one-token step from the rotary embedding's ``(cos, sin)`` (``[B, 1, dim]``)."""
        cos, sin = position_embeddings
        half = sin.shape[-1] // 2
        return RotaryFactors(cos=cos, signed_sin=torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))

    def run_layer(self, layer_index: int, hidden_states: torch.Tensor, caches: Sequence[DynamicCache],
                  factors: RotaryFactors) -> torch.Tensor:
        """Layer ``layer_index`` on ``hidden_states`` ``[B, 1, hidden]``, row i of one session appending its key and
        value to ``caches[i]`` and attending that cache alone (as a batched step's rows do: row_attention.py)."""
        layer = self._layers[layer_index]
        qkv_product, gate_up_product = self._shared[layer_index]
        attention = layer.self_attn
        rows, head_dim = hidden_states.shape[0], attention.head_dim
        residual = hidden_states
        normed = layer.input_layernorm(hidden_states)
        heads_and_keys, values = _rotated_queries_and_keys(attention, normed, factors, qkv_product)
        query_heads = attention.config.num_attention_heads
        queries = heads_and_keys[:, :query_heads].view(rows, 1, query_heads, -1).transpose(1, 2)
        keys = heads_and_keys[:, query_heads:].view(rows, 1, -1, head_dim).transpose(1, 2)
        values = values.reshape(rows, 1, -1, head_dim).transpose(1, 2)
        if rows == 1:
            attended = _attend(attention, queries, keys, values, caches[0], layer_index)
        else:
            attended = torch.cat([_attend(attention, queries[row:row + 1], keys[row:row + 1], values[row:row + 1],
                                          cache, layer_index) for row, cache in enumerate(caches)])
        hidden_states = residual + attention.o_proj(attended.reshape(rows, 1, -1).contiguous())
        residual = hidden_states
        normed = layer.post_attention_layernorm(hidden_states)
        mlp = layer.mlp
        if gate_up_product is None:
            return residual + mlp(normed)
        gate, up = _columns(gate_up_product, normed)
        return residual + mlp.down_proj((mlp.act_fn(gate) * up).view(rows, 1, -1))


def _attend(attention: nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            cache: DynamicCache, layer_index: int) -> torch.Tensor:
    """One session's query ``[1, heads, 1, dim]`` over `cache` once its key and value are appended: ``[1, 1, heads,
    dim]``."""
    keys, values = cache.update(keys, values, layer_index)
    return sdpa_attention_forward(attention, queries, keys, values, None, dropout=0.0, scaling=attention.scaling)[0]


def _rotated_queries_and_keys(attention: nn.Module, normed: torch.Tensor, factors: RotaryFactors,
                              qkv_product: SharedRowProduct | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, query heads + key heads, head_dim]`` rotated, and the values (any shape holding one row per session)."""
    rows = normed.shape[0]
    if qkv_product is not None:
        queries, keys, values = _columns(qkv_product, normed)
    else:
        queries, keys, values = attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
    both = torch.cat((queries.reshape(rows, -1), keys.reshape(rows, -1)), dim=-1).view(rows, -1, attention.head_dim)
    half = attention.head_dim // 2
    return both * factors.cos + torch.roll(both, half, -1) * factors.signed_sin, values


def _shared_by(linears: Sequence[nn.Module]) -> SharedRowProduct | None:
    """The product `linears` share, if they are its members in order and have no biases (QuantizedLinear.shared)."""
    shared = getattr(linears[0], "shared", None)
    if shared is None or any(getattr(linear, "shared", None) != (shared[0], index) or linear.bias is not None
                             for index, linear in enumerate(linears)):
        return None
    return shared[0]


def _columns(product: SharedRowProduct, normed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each member's output for the rows of ``normed``, as views of one call of `product`."""
    columns = product.all_columns(normed.reshape(normed.shape[0], -1)).to(normed.dtype)
    return tuple(columns[:, first:last] for first, last in product.bounds)


def lean_decode_supported(config: PretrainedConfig, attention_types: Sequence[str], layers: dict[int, nn.Module],
                          ) -> bool:
    """Whether `layers` are of a family and kind this module computes (before the bitwise check)."""
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) not in SDPA_IMPLEMENTATIONS:
        return False
    if any(attention_types[index] != FULL_ATTENTION for index in layers):
        return False
    return all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers.values())


class LeanSlot:
    """A stack's LeanDecoder, checked the first time it is asked for (under the runner's lock)."""

    def __init__(self, check: Callable[[], LeanDecoder | None]) -> None:
        self._check: Callable[[], LeanDecoder | None] | None = check
        self._decoder: LeanDecoder | None = None

    def decoder(self) -> LeanDecoder | None:
        """The checked LeanDecoder, or None where the check refused it or failed (the modules then run every step)."""
        if self._check is not None:
            check, self._check = self._check, None
            try:
                self._decoder = check()
            except Exception:  # a check that cannot run must not fail the step that asked for it
                logger.warning("one-token steps keep transformers' modules: the lean step's check failed",
                               exc_info=True)
        return self._decoder


class ReferenceStack(Protocol):
    """What the check needs of a runner's DecoderStack (hearth/inference/layer_pass.py), a dataclass whose ``lean``
    field holds its LeanSlot."""

    config: PretrainedConfig
    layers: dict[int, nn.Module]
    attention_types: Sequence[str]

    def layer_pass(self, cache: DynamicCache, hidden_states: torch.Tensor, start_pos: int, run_lo: int,
                   run_hi: int, replay: bool = False, lean: bool = True): ...


def verified_lean_decoder(stack: ReferenceStack, new_cache: Callable[[], DynamicCache]) -> LeanDecoder | None:
    """A LeanDecoder for `stack`'s layers if they are supported and its steps, run on scratch caches from `new_cache`
    beside transformers' modules (the stack's own passes), give bitwise the same outputs and cache contents; None
    otherwise."""
    layers = stack.layers
    if not layers or not lean_decode_supported(stack.config, stack.attention_types, layers):
        return None
    lean = LeanDecoder(layers)
    # The candidate's steps run through the stack's own one-token pass, as they will once kept.
    candidate = dataclasses.replace(stack, lean=LeanSlot(lambda: lean))
    first, last = min(layers), max(layers)
    norm_weight = layers[first].input_layernorm.weight
    generator = torch.Generator().manual_seed(0)
    steps = torch.randn(1, _CHECK_PREFILL_TOKENS + _CHECK_STEPS, stack.config.hidden_size, generator=generator)
    steps = steps.to(device=norm_weight.device, dtype=norm_weight.dtype)
    with torch.inference_mode():
        reference_cache, lean_cache = new_cache(), new_cache()
        for cache in (reference_cache, lean_cache):
            stack.layer_pass(cache, steps[:, :_CHECK_PREFILL_TOKENS], 0, first, last).run()
        for position in range(_CHECK_PREFILL_TOKENS, _CHECK_PREFILL_TOKENS + _CHECK_STEPS):
            token = steps[:, position:position + 1]
            expected = stack.layer_pass(reference_cache, token, position, first, last, lean=False).run()
            got = candidate.layer_pass(lean_cache, token, position, first, last).run()
            if not torch.equal(expected, got):
                logger.info("one-token steps keep transformers' modules: the lean step differs on this install")
                return None
        for index in range(first, last + 1):
            mine, theirs = lean_cache.layers[index], reference_cache.layers[index]
            if not (torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)):
                logger.info("one-token steps keep transformers' modules: the lean step caches other keys")
                return None
    return lean
