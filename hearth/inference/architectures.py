"""Per-family adapters: the few places where supported architectures differ, looked up by model_type.

Everything that a family does *inside* a decoder layer (Qwen3's q/k norms, Phi-3's fused qkv and
gate/up projections, Gemma 2's sandwich norms and attention soft-capping) is handled by the public
transformers decoder-layer class itself, so an adapter only covers what happens *around* the layers:
which attention mask each layer needs, buffers that a meta-device skeleton cannot carry (Gemma 2's
embedding scale), and post-processing of the logits (Gemma 2's final soft-capping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from .errors import UnsupportedArchitectureError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ArchitectureAdapter:
    """The default behaviour, right for Llama-style decoders; subclasses override only their quirk."""

    model_type: str
    architecture: str
    notes: str = ""

    def attention_types(self, config: PretrainedConfig) -> list[str]:
        """Attention kind of every layer, with the rule transformers' DynamicCache uses for its layers."""
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return list(layer_types)
        kind = SLIDING_ATTENTION if getattr(config, "sliding_window", None) is not None else FULL_ATTENTION
        return [kind] * config.num_hidden_layers

    def materialize_embedding_buffers(self, embedding: nn.Module) -> None:
        """Give real values to non-persistent buffers of the embedding module (none by default)."""

    def postprocess_logits(self, logits: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
        """Transform lm_head output the way the family's *ForCausalLM.forward does (identity by default)."""
        return logits


@dataclass(frozen=True)
class Gemma2Adapter(ArchitectureAdapter):
    """Gemma 2: embeddings scaled by sqrt(hidden_size) and tanh soft-capping of the final logits."""

    def materialize_embedding_buffers(self, embedding: nn.Module) -> None:
        # Gemma2TextScaledWordEmbedding keeps its scale as a non-persistent buffer created in the
        # model's dtype (so bf16 rounds sqrt(3072) to 55.5, exactly as from_pretrained does).
        scale_buffer = embedding.embed_scale
        embedding.embed_scale = torch.full((), embedding.scalar_embed_scale, dtype=scale_buffer.dtype,
                                            device=embedding.weight.device)

    def postprocess_logits(self, logits: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is None:
            return logits
        return torch.tanh(logits / softcap) * softcap


_ADAPTERS: dict[str, ArchitectureAdapter] = {
    adapter.model_type: adapter
    for adapter in (
        ArchitectureAdapter("llama", "LlamaForCausalLM"),
        ArchitectureAdapter("mistral", "MistralForCausalLM", notes="sliding window on every layer if set"),
        ArchitectureAdapter("qwen2", "Qwen2ForCausalLM", notes="per-layer types via config.layer_types"),
        ArchitectureAdapter("qwen3", "Qwen3ForCausalLM", notes="q/k norms live in Qwen3DecoderLayer"),
        ArchitectureAdapter("phi3", "Phi3ForCausalLM", notes="fused qkv/gate_up live in Phi3DecoderLayer"),
        Gemma2Adapter("gemma2", "Gemma2ForCausalLM", notes="embedding scale, final logit soft-capping"),
        Gemma2Adapter("gemma3_text", "Gemma3ForCausalLM",
                      notes="embedding scale; local and global layers rotate on bases of their own"),
    )
}


def supported_architectures() -> list[str]:
    """Class names of every supported architecture, sorted, for messages and docs."""
    return sorted(adapter.architecture for adapter in _ADAPTERS.values())


def adapter_for(config: PretrainedConfig) -> ArchitectureAdapter:
    """The adapter for a config, or UnsupportedArchitectureError naming it and the supported ones."""
    adapter = _ADAPTERS.get(getattr(config, "model_type", None))
    if adapter is None:
        architectures = getattr(config, "architectures", None) or []
        named = ", ".join(architectures) or "<none listed>"
        raise UnsupportedArchitectureError(
            f"unsupported architecture {named} (model_type {getattr(config, 'model_type', None)!r}); "
            f"hearth supports: {', '.join(supported_architectures())}"
        )
    return adapter
