"""`hearth eval`: the next-token quality of quantized weights against the same weights in float32 over a text, run
through the very runner and head code the mesh serves with (inference.load_full), and its report."""

from __future__ import annotations

import gc
import logging
import math
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel
from tqdm import tqdm

from hearth.inference import (
    CheckpointError, InferenceError, LocalModel, QuantizationError, load_full, read_config_dict,
)
from hearth.inference.gguf_int4 import STORED_INT4_GROUP_SIZES
from hearth.inference.memory import layer_tensor_specs, layer_weight_bytes_of, weights_held_as_stored, \
    weights_kept_precise, weights_rounded_again
from hearth.inference.stored_precision import resolved_scheme
from hearth.services.devtools.bench.eval_options import EVAL_MAX_TEXT_BYTES, EvalOptions
from hearth.services.devtools.bench.quality_metrics import QualityTotals, compare_logits
from hearth.services.cli_options import EXIT_BAD_INPUT
from hearth.services.common.config_processes import ShardSettings
from hearth.services.devtools.demo import DemoError, resolve_demo_model
from hearth.services.devtools.random_models import RANDOM_MARKER_FILE, UnknownRandomShape

EXIT_FAILED = 1
# What "full precision" means here: the reference holds the checkpoint's weights in float32 on the CPU.
REFERENCE_DTYPE = torch.float32
# Only this many characters per wanted token are tokenized: no tokenizer's tokens are longer on average.
TEXT_CHARS_PER_TOKEN_BOUND = 64


class EvalInputError(ValueError):
    """Input `hearth eval` cannot measure: a missing, empty or non-UTF-8 text, an unknown scheme or model."""


class StoredBlocksHeld(BaseModel):
    """A GGUF's 4-bit blocks a scheme serves as they are stored (held_forms.held_as_stored): int8, and int4 of the
    stored group, hold them alike, so their figures agree on those weights."""

    weights: dict[str, int]  # GGUF block type -> decoder-layer weights stored in it and served so
    held_in: str  # the scheme those weights are held in: int4 of the stored groups ("int4/g32")


class PreciseBlocksKept(BaseModel):
    """A 4-bit mix's more precise blocks (Q6_K, Q5_K, Q8_0 ... in layers mostly of 4-bit blocks) that int4 holds in
    int8 rather than rounding them to 4 bits (held_forms.kept_precise), as int8 does: their figures agree on them."""

    weights: dict[str, int]  # GGUF block type -> decoder-layer weights stored in it and held in int8
    held_in: str = "int8"


class SchemeQuality(BaseModel):
    scheme: str
    mean_kl_nats: float
    max_kl_nats: float
    top1_agreement: float
    perplexity: float
    # The decoder layers' bytes as the scheme holds them, in bits per weight (norms included): what a host's memory
    # pays for the figures beside it.
    bits_per_weight: float
    # None: the scheme rounds every layer weight itself.
    held_as_stored: StoredBlocksHeld | None = None
    # None: the scheme keeps no layer weight in more bits than its own.
    kept_precise: PreciseBlocksKept | None = None
    # GGUF block type -> decoder-layer weights stored quantized that the scheme rounds again into its own codes (no
    # kernel here holds those blocks as stored: what it loses comes on top of the file's own loss); None: none.
    rounded_again: dict[str, int] | None = None


class EvalReport(BaseModel):
    model: str
    # The checkpoint the schemes were compared against (--reference); None: the model's own weights.
    reference: str | None = None
    text: str
    token_source: str  # "tokenizer", or "utf8_bytes" for random:<shape> models and checkpoints without a tokenizer
    context_tokens: int
    windows: int
    positions: int
    reference_dtype: str
    reference_perplexity: float
    schemes: list[SchemeQuality]


def run_eval_command(options: EvalOptions, *, as_json: bool) -> int:
    """`hearth eval`: progress on stderr, the report on stdout; 2 on bad input, 1 when the model fails to run."""
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    try:
        report = evaluate(options)
    except (EvalInputError, CheckpointError) as error:  # a checkpoint hearth cannot read is bad input too
        print(f"hearth eval: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InferenceError as error:
        print(f"hearth eval: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("hearth eval: interrupted", file=sys.stderr)
        return 130
    print(report.model_dump_json(indent=2) if as_json else format_eval_report(report))
    return 0


def evaluate(options: EvalOptions) -> EvalReport:
    """Every scheme of ``options`` against float32 over the text's windows; the float32 model stays loaded and one
    quantized model at a time beside it."""
    text = read_eval_text(options.text)
    try:
        model_path = resolve_demo_model(options.model).path
    except (DemoError, UnknownRandomShape) as error:
        raise EvalInputError(str(error)) from None
    reference_path = _reference_path(options.reference) if options.reference is not None else model_path
    schemes = [_scheme(label, model_path) for label in options.schemes]
    _check_context(model_path, options.context_tokens)
    reference = _load_whole(reference_path, "none")
    try:
        feed_bytes = (model_path / RANDOM_MARKER_FILE).is_file() or not reference.head.has_tokenizer
        token_ids = text_token_ids(reference, text, options.max_tokens, feed_bytes=feed_bytes)
        windows = token_windows(token_ids, options.context_tokens)
        if not windows:
            raise EvalInputError(f"{options.text} holds fewer than 2 tokens: nothing to predict")
        positions = sum(len(window) - 1 for window in windows)
        results: list[tuple[str, QualityTotals, StoredBlocksHeld | None, PreciseBlocksKept | None,
                            dict[str, int] | None]] = []
        with tqdm(total=positions * len(schemes), unit="tok", file=sys.stderr, desc="hearth eval") as progress:
            for scheme in schemes:
                progress.set_description(f"{scheme.label}: loading")
                results.append((scheme.label, *_measure_scheme(reference, model_path, scheme, windows, progress,
                                                               text if reference_path != model_path else None)))
    finally:
        reference.close()
    return EvalReport(
        model=str(options.model or model_path.name), reference=options.reference, text=str(options.text),
        token_source="utf8_bytes" if feed_bytes else "tokenizer", context_tokens=options.context_tokens,
        windows=len(windows), positions=positions, reference_dtype=str(REFERENCE_DTYPE).removeprefix("torch."),
        reference_perplexity=results[0][1].reference_perplexity,
        schemes=[SchemeQuality(scheme=label, mean_kl_nats=totals.mean_kl_nats, max_kl_nats=totals.max_kl_nats,
                               top1_agreement=totals.top1_agreement, perplexity=totals.quantized_perplexity,
                               bits_per_weight=layer_bits_per_weight(model_path, label),
                               held_as_stored=held, kept_precise=kept, rounded_again=again)
                 for label, totals, held, kept, again in results])


def _load_whole(model_path: Path, quantization) -> LocalModel:
    """The whole model in REFERENCE_DTYPE, its KV caches bounded as a shard's are by default."""
    shard = ShardSettings()
    return load_full(model_path, dtype=REFERENCE_DTYPE, quantization=quantization,
                     cache_budget_bytes=shard.kv_cache_budget_bytes, session_ttl_s=shard.eviction_idle_s)


def _measure_scheme(reference: LocalModel, model_path: Path, scheme, windows: Sequence[list[int]], progress,
                    other_reference_text: str | None) -> tuple[QualityTotals, StoredBlocksHeld | None,
                                                              PreciseBlocksKept | None, dict[str, int] | None]:
    try:
        quantized = _load_whole(model_path, scheme)
    except QuantizationError as error:  # a scheme this model's shapes cannot take (an int4 group size)
        raise EvalInputError(f"--quantize {scheme.label}: {error}") from None
    try:
        if other_reference_text is not None:
            _check_same_model(reference, quantized, other_reference_text)
        progress.set_description(scheme.label)
        totals = QualityTotals()
        for window in windows:
            targets = torch.tensor(window[1:], dtype=torch.long)
            totals += compare_logits(window_logits(reference, window), window_logits(quantized, window), targets)
            progress.update(len(window) - 1)
        kept = weights_kept_precise(model_path, scheme)
        again = weights_rounded_again(model_path, scheme, device=quantized.runner.device)
        return totals, stored_blocks_held(model_path, scheme, quantized.runner.device), \
            PreciseBlocksKept(weights=kept) if kept else None, again or None
    finally:
        quantized.close()
        del quantized
        gc.collect()  # its weights go before the next scheme's load


def window_logits(model: LocalModel, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 ``[T - 1, vocab]`` next-token logits at every position of a T-token window but the last, from one
    prefill at position 0 through the runner, then the head's own norm and lm_head (``batch_logits``, one row per
    position: each row's logits as a one-token state's)."""
    session_id = f"eval-{uuid.uuid4().hex}"
    try:
        hidden = model.runner.forward(session_id, model.head.embed(token_ids), 0, "prefill")
    finally:
        model.runner.reset(session_id)
    logits, _bound = model.head.batch_logits([hidden[:, index:index + 1, :] for index in range(hidden.shape[1] - 1)])
    return logits


def text_token_ids(model: LocalModel, text: str, max_tokens: int, *, feed_bytes: bool) -> list[int]:
    """The first ``max_tokens`` token ids of ``text``: by the model's tokenizer, or its UTF-8 bytes (modulo the
    vocabulary) where ``feed_bytes`` (a random model's word-level tokenizer would read any text as unknown words)."""
    prefix = text[: max_tokens * TEXT_CHARS_PER_TOKEN_BOUND]
    if feed_bytes:
        vocab_size = model.info.vocab_size
        return [byte % vocab_size for byte in prefix.encode("utf-8")[:max_tokens]]
    return list(model.head.tokenizer(prefix, verbose=False)["input_ids"])[:max_tokens]


def token_windows(token_ids: Sequence[int], context_tokens: int) -> list[list[int]]:
    """Consecutive windows of at most ``context_tokens`` ids; a last window of fewer than 2 ids predicts nothing
    and is left out."""
    windows = [list(token_ids[start:start + context_tokens]) for start in range(0, len(token_ids), context_tokens)]
    return [window for window in windows if len(window) >= 2]


def read_eval_text(path: Path) -> str:
    """The text of ``path``, or EvalInputError naming why it cannot be read as non-empty UTF-8."""
    try:
        if not path.is_file():
            raise EvalInputError(f"--text {path}: no such file (pass --text PATH to a UTF-8 text)")
        size = path.stat().st_size
        if size > EVAL_MAX_TEXT_BYTES:
            raise EvalInputError(f"--text {path}: {size} bytes, more than the {EVAL_MAX_TEXT_BYTES} read")
        data = path.read_bytes()
    except OSError as error:
        raise EvalInputError(f"--text {path}: unreadable ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise EvalInputError(f"--text {path}: not UTF-8 text (invalid byte at offset {error.start})") from None
    if not text.strip():
        raise EvalInputError(f"--text {path}: empty")
    return text


def _scheme(label: str, model_path: Path):
    """The scheme `label` names (auto: the one the model is stored in, hearth/inference/stored_precision.py)."""
    try:
        return resolved_scheme(label, model_path, "cpu")
    except QuantizationError as error:
        raise EvalInputError(f"--quantize: {error}") from None


def _reference_path(reference: str) -> Path:
    try:
        return resolve_demo_model(reference).path
    except (DemoError, UnknownRandomShape) as error:
        raise EvalInputError(f"--reference: {error}") from None


def _check_same_model(reference: LocalModel, quantized: LocalModel, text: str) -> None:
    """EvalInputError unless --reference is a checkpoint of the model measured: the same vocabulary, and the same
    token ids for the start of the text (else its logits would be compared with another model's tokens)."""
    sizes = (reference.info.vocab_size, quantized.info.vocab_size)
    if sizes[0] != sizes[1]:
        raise EvalInputError(f"--reference: a vocabulary of {sizes[0]} tokens, the model's {sizes[1]}: not a "
                             "checkpoint of the same model")
    sample = text[:TEXT_CHARS_PER_TOKEN_BOUND * 64]
    if reference.head.has_tokenizer and quantized.head.has_tokenizer and (
            list(reference.head.tokenizer(sample, verbose=False)["input_ids"])
            != list(quantized.head.tokenizer(sample, verbose=False)["input_ids"])):
        raise EvalInputError("--reference: it tokenizes the text otherwise than the model: not a checkpoint of the "
                             "same model")


def _check_context(model_path: Path, context_tokens: int) -> None:
    try:
        config = read_config_dict(model_path)
    except (InferenceError, OSError, ValueError) as error:
        raise EvalInputError(f"--model: {error}") from None
    max_positions = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings")
    if isinstance(max_positions, int) and context_tokens > max_positions:
        raise EvalInputError(f"--context-tokens {context_tokens}: more than the model's {max_positions} positions")


def layer_bits_per_weight(model_path: Path, scheme: str) -> float:
    """Bits a decoder-layer weight of the model takes on average under `scheme` on the CPU, computing in
    REFERENCE_DTYPE (hearth/inference/memory.py's figures, which hosts plan with)."""
    specs = layer_tensor_specs(model_path)
    weights = sum(math.prod(shape) for _, _, shape in specs)
    held = sum(layer_weight_bytes_of(specs, REFERENCE_DTYPE, scheme, device="cpu").values())
    return 8 * held / weights if weights else float("nan")


def stored_blocks_held(model_path: Path, scheme, device) -> StoredBlocksHeld | None:
    """The GGUF's 4-bit blocks `scheme` serves as stored on `device` (None: it rounds every layer weight itself)."""
    weights = weights_held_as_stored(model_path, scheme, device=device)
    if not weights:
        return None
    groups = sorted({STORED_INT4_GROUP_SIZES[block_type] for block_type in weights})
    return StoredBlocksHeld(weights=weights, held_in=", ".join(f"int4/g{group}" for group in groups))


def format_eval_report(report: EvalReport) -> str:
    """The report as a table: one row for the float32 reference, one per scheme."""
    against = f", against {report.reference}" if report.reference is not None else ""
    lines = [f"hearth eval: {report.model} on {report.text} ({report.token_source}): {report.positions} positions "
             f"in {report.windows} windows of up to {report.context_tokens} tokens{against}",
             f"{'scheme':<14} {'KL (nats)':>11} {'max KL':>10} {'top-1 agree':>12} {'perplexity':>12} "
             f"{'bits/weight':>12}",
             f"{report.reference_dtype + ' (ref)':<14} {'-':>11} {'-':>10} {'-':>12} "
             f"{_number(report.reference_perplexity):>12} {'-':>12}"]
    for row in report.schemes:
        lines.append(f"{row.scheme:<14} {row.mean_kl_nats:>11.6f} {row.max_kl_nats:>10.4f} "
                     f"{100 * row.top1_agreement:>10.2f} % {_number(row.perplexity):>12} "
                     f"{row.bits_per_weight:>12.2f}")
    for row in report.schemes:
        if (held := row.held_as_stored) is not None:
            blocks = ", ".join(f"{count} {block_type}" for block_type, count in held.weights.items())
            lines.append(f"{row.scheme}: serves the GGUF's stored 4-bit blocks as they are ({blocks} layer weights, "
                         f"held in {held.held_in}), so it agrees with any scheme that does so on those weights")
        if (kept := row.kept_precise) is not None:
            blocks = ", ".join(f"{count} {block_type}" for block_type, count in kept.weights.items())
            lines.append(f"{row.scheme}: keeps the 4-bit mix's more precise blocks in {kept.held_in} ({blocks} layer "
                         f"weights), as {kept.held_in} does, rather than rounding them to 4 bits")
        if (again := row.rounded_again) is not None:
            blocks = ", ".join(f"{count} {block_type}" for block_type, count in again.items())
            lines.append(f"{row.scheme}: rounds the GGUF's quantized blocks again into its own codes ({blocks} layer "
                         f"weights: no kernel here holds them as stored), a loss on top of the file's own")
    return "\n".join(lines)


def _number(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else str(value)
