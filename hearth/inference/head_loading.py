"""Building the orchestrator's part of a model, its Head: tokenizer, embedding, final norm and lm_head, read from the
checkpoint through hearth/inference/loading.py's meta-device skeleton (only those tensors), the lm_head held as the
scheme says (hearth/inference/head_weights.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig

from .errors import CheckpointError
from .gguf_checkpoint import GGUFCheckpoint, load_gguf_tokenizer
from hearth.formats.gguf_support import is_gguf_file
from .head import Head
from .head_weights import served_lm_head, served_lm_head_of_rows
from .heap import bound_arena_tops, release_freed_heap
from .loading import assert_materialized, open_skeleton
from .quantization import QuantizationScheme, check_device_supports
from .stored_embedding import embedding_from_stored_rows
from .stored_precision import resolved_head_scheme

logger = logging.getLogger(__name__)


def load_head(
    model: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    model_id: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool | None = None,
    load_tokenizer: bool = True,
    quantization: str | QuantizationScheme = "none",
) -> Head:
    """The orchestrator's part of ``model``: tokenizer, embedding, final norm and lm_head (tied or not).

    ``quantization`` other than "none" holds the lm_head in int8 on the CPU, or in float16 where the checkpoint stores
    it quantized already (hearth/inference/head_weights.py; "auto": as its weight is stored,
    hearth/inference/stored_precision.py); the embedding (a lookup) and the final norm stay at full precision."""
    skeleton = open_skeleton(
        model,
        dtype=dtype,
        device=device,
        attn_implementation=None,
        model_id=model_id,
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
    )
    decoder = skeleton.model.get_decoder()
    embed_tokens = skeleton.model.get_input_embeddings()
    lm_head = skeleton.model.get_output_embeddings()
    final_norm = decoder.norm
    lm_head_name, embed_name = skeleton.name_of(lm_head) + ".weight", skeleton.name_of(embed_tokens) + ".weight"
    tied = skeleton.info.tie_word_embeddings or lm_head_name not in skeleton.checkpoint
    if tied and not skeleton.info.tie_word_embeddings:
        raise CheckpointError(f"{lm_head_name} is missing and the config does not tie it to the embedding")
    head_weight_name = embed_name if tied else lm_head_name
    stored_quantized = skeleton.checkpoint.stored_quantized(head_weight_name)
    scheme = resolved_head_scheme(quantization, stored_quantized, skeleton.device)
    check_device_supports(scheme, skeleton.device)
    built = _head_of_stored_rows(skeleton, lm_head, head_weight_name, scheme, stored_quantized, tied)
    # An embedding the file can look up row by row is never read whole (stored_embedding.py) where nothing else
    # uses its matrix: untied, or tied to a head built from the file's rows.
    stored_rows = None if tied and built is None else embedding_from_stored_rows(
        skeleton.checkpoint, embed_name, embed_tokens, built or lm_head, skeleton.device)
    if stored_rows is None:
        skeleton.materialize(embed_tokens)
        skeleton.adapter.materialize_embedding_buffers(embed_tokens)
    skeleton.materialize(final_norm)
    if built is None and tied:
        lm_head.weight = embed_tokens.weight
    elif built is None:
        skeleton.materialize(lm_head)
    for what, module in (("embedding", stored_rows or embed_tokens), ("final norm", final_norm),
                         ("lm_head", built or lm_head)):
        assert_materialized(module, what)
    served = built or served_lm_head(lm_head, scheme, skeleton.device, stored_quantized)
    if tied and built is None:
        stored_rows = embedding_from_stored_rows(skeleton.checkpoint, embed_name, embed_tokens, served,
                                                 skeleton.device)
    if served is not lm_head or stored_rows is not None:
        lm_head, embed_tokens = served, stored_rows or embed_tokens
        skeleton.model.set_output_embeddings(lm_head)
        skeleton.model.set_input_embeddings(embed_tokens)
        release_freed_heap()
    if skeleton.device.type == "cpu":
        bound_arena_tops()
    tokenizer = _load_tokenizer(skeleton.info.path) if load_tokenizer else None
    eos_token_ids = _eos_token_ids(skeleton.info.path, skeleton.config, tokenizer)
    if isinstance(skeleton.checkpoint, GGUFCheckpoint):
        eos_token_ids |= skeleton.checkpoint.stop_token_ids()
    return Head(
        info=skeleton.info,
        config=skeleton.config,
        adapter=skeleton.adapter,
        embed_tokens=embed_tokens,
        final_norm=final_norm,
        lm_head=lm_head,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        checkpoint_bytes_read=skeleton.checkpoint.bytes_read,
        device=skeleton.device,
    )


def _head_of_stored_rows(skeleton, lm_head: nn.Module, weight_name: str, scheme: QuantizationScheme,
                         stored_quantized: bool, tied: bool) -> nn.Module | None:
    """The module served_lm_head would give for `lm_head` (still on the meta device), built from the checkpoint's
    rows a chunk at a time where it reads rows (head_weights.served_lm_head_of_rows); None where it loads as before:
    no such module, or a head tied to an embedding that is held whole anyway (one the file cannot look up by row)."""
    row_chunks = getattr(skeleton.checkpoint, "row_chunks", None)
    if row_chunks is None or (tied and getattr(skeleton.checkpoint, "row_reader", None) is None):
        return None
    return served_lm_head_of_rows(lm_head, scheme, skeleton.device, stored_quantized,
                                  lambda rows_per_chunk: row_chunks(weight_name, rows_per_chunk))


def _load_tokenizer(path: Path):
    try:
        return load_gguf_tokenizer(path) if is_gguf_file(path) else AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:  # KeyError: transformers' GGUF reader on a file with no token list
        logger.warning("no usable tokenizer in %s: %s", path, exc)
        return None


def _eos_token_ids(path: Path, config: PretrainedConfig, tokenizer) -> set[int]:
    """End-of-sequence ids as generate() uses them: generation_config.json, config, and the tokenizer's."""
    candidates: list = []
    if path.is_dir() and (path / "generation_config.json").is_file():
        candidates.append(GenerationConfig.from_pretrained(path).eos_token_id)
    candidates.append(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    ids: set[int] = set()
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, (list, tuple)):
            ids.update(int(t) for t in candidate)
    return ids
