"""The `hearth eval` command line and its defaults (its body is services/bench/quality.py, imported only when it runs,
so `hearth` starts without torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

# Debian's fortunes corpus (the bundled model's training text), where the `fortunes` package is installed.
EVAL_DEFAULT_TEXT = Path("/usr/share/games/fortunes/fortunes")
EVAL_DEFAULT_SCHEMES = ("int8", "int4")
EVAL_DEFAULT_CONTEXT_TOKENS = 256
EVAL_DEFAULT_MAX_TOKENS = 4096
# Bounds at the boundary: each scored position keeps a [vocab] float row per model at a time, and the whole text
# is read and checked as UTF-8 before any of it is tokenized.
EVAL_MAX_TOKENS_LIMIT = 1 << 20
EVAL_MAX_TEXT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class EvalOptions:
    text: Path
    model: str | None = None
    schemes: tuple[str, ...] = EVAL_DEFAULT_SCHEMES
    context_tokens: int = EVAL_DEFAULT_CONTEXT_TOKENS
    max_tokens: int = EVAL_DEFAULT_MAX_TOKENS


def eval_command(
    model: Annotated[
        Optional[str], typer.Option("--model", help="Checkpoint folder, hub id in the local cache, or random:<shape> "
                                    "(default: the bundled model).", show_default=False)
    ] = None,
    text: Annotated[
        Path, typer.Option("--text", help="UTF-8 text to predict (random:<shape> models and checkpoints without a "
                           "tokenizer read its UTF-8 bytes as token ids).")
    ] = EVAL_DEFAULT_TEXT,
    quantize: Annotated[
        Optional[list[str]], typer.Option("--quantize", help="A scheme to compare with full precision: int8, int4, "
                                          "int4/gN, none (repeatable; default: int8 and int4).", show_default=False)
    ] = None,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", min=2, help="Tokens per window; each window is one prefill from "
                          "position 0.")
    ] = EVAL_DEFAULT_CONTEXT_TOKENS,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=2, max=EVAL_MAX_TOKENS_LIMIT, help="Most tokens of the text read.")
    ] = EVAL_DEFAULT_MAX_TOKENS,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Next-token quality of quantized weights against the same weights in float32 over a text: KL divergence,
    top-1 agreement and perplexity (progress on stderr, report on stdout; exit code 2 on bad input)."""
    from services.bench.quality import run_eval_command

    options = EvalOptions(text=text, model=model, schemes=tuple(quantize or EVAL_DEFAULT_SCHEMES),
                          context_tokens=context_tokens, max_tokens=max_tokens)
    raise typer.Exit(run_eval_command(options, as_json=as_json))
