"""The `hearth eval` command line (its body is hearth/services/devtools/bench/quality.py, imported only when it runs, so
`hearth` starts without torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hearth.services.model_options import checked_quantize
from hearth.services.devtools.bench.eval_options import (
    EVAL_DEFAULT_CONTEXT_TOKENS,
    EVAL_DEFAULT_MAX_TOKENS,
    EVAL_DEFAULT_SCHEMES,
    EVAL_DEFAULT_TEXT,
    EVAL_DEFAULT_TEXT_SHOWN,
    EVAL_MAX_TOKENS_LIMIT,
    EvalOptions,
)


def eval_command(
    model: Annotated[
        Optional[str], typer.Option("--model", help="Checkpoint folder, GGUF file, hub id in the local cache, or "
                                    "random:<shape> (default: the bundled model).", show_default=False)
    ] = None,
    text: Annotated[
        Path, typer.Option("--text", show_default=EVAL_DEFAULT_TEXT_SHOWN,
                           help="UTF-8 text to predict (random:<shape> models and checkpoints without a tokenizer "
                                "read its UTF-8 bytes as token ids); the default ships with hearth.")
    ] = EVAL_DEFAULT_TEXT,
    quantize: Annotated[
        Optional[list[str]], typer.Option("--quantize", callback=checked_quantize, show_default=False,
                                          help="A scheme to compare with full precision: int8, int4, int4/gN, none "
                                               "(repeatable; default: int8 and int4).")
    ] = None,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", min=2, help="Tokens per window; each window is one prefill from "
                          "position 0.")
    ] = EVAL_DEFAULT_CONTEXT_TOKENS,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=2, max=EVAL_MAX_TOKENS_LIMIT, help="Most tokens of the text read.")
    ] = EVAL_DEFAULT_MAX_TOKENS,
    reference: Annotated[
        Optional[str], typer.Option("--reference", show_default=False,
                                    help="Compare against this checkpoint of the same model in float32 instead of "
                                         "the model's own weights (the one a GGUF was made from: what the file's "
                                         "quantization loses counts too; --quantize none measures the file alone).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Next-token quality of quantized weights against the same weights in float32 (or another checkpoint of the
    model: --reference) over a text: KL divergence, top-1 agreement and perplexity (progress on stderr, report on
    stdout; exit code 2 on bad input)."""
    from hearth.services.common.process_gc import freeze_startup_objects
    from hearth.services.devtools.bench.quality import run_eval_command

    freeze_startup_objects()  # it runs no event loop: its imports are done here
    options = EvalOptions(text=text, model=model, schemes=tuple(quantize or EVAL_DEFAULT_SCHEMES),
                          context_tokens=context_tokens, max_tokens=max_tokens, reference=reference)
    raise typer.Exit(run_eval_command(options, as_json=as_json))
