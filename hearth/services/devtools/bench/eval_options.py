"""What `hearth eval` compares and its bounds: the options its command line fills and its body reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hearth.services.common.hearth_files import data_dir

# Text every hearth has, in a checkout and in its wheel: docs/design.md, about 150 kB of English prose (some 60 000
# tokens of the bundled model's, 150 000 UTF-8 bytes of a random model's), far more than EVAL_DEFAULT_MAX_TOKENS.
EVAL_DEFAULT_TEXT = data_dir("docs") / "design.md"
EVAL_DEFAULT_TEXT_SHOWN = "hearth's own docs/design.md"
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
    # Another full-precision checkpoint of the same model to compare against (the one a GGUF was made from); None:
    # the model's own weights in float32.
    reference: str | None = None
