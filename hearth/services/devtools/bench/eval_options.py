"""What `hearth eval` compares and its bounds: the options its command line fills and its body reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
