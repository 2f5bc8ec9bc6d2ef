"""TokenLowerBound: how many tokens a text needs at least, found without tokenizing it, so a prompt far beyond a
model's context is refused at once instead of after seconds of tokenization.

Why it holds: a fast tokenizer normalizes the text, splits it into pieces and covers every piece with
vocabulary entries. A vocabulary entry's string is at least as long as the text it covers (byte-level BPE
writes one character per byte, SentencePiece one per character, byte-fallback tokens like `<0xE4>` and
WordPiece's `##` continuations are longer still), so the normalized text needs at least
`len(normalized) / longest entry` tokens. The bound is only trusted when no step of the tokenizer throws text
away (whitespace-dropping pre-tokenizers, WordPiece's one `[UNK]` for an over-long word): for those, and for
slow tokenizers, it is 0 and the caller tokenizes.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Pre-tokenizers that drop the characters they split on: the text left is shorter than the text given.
_TEXT_DROPPING_PRE_TOKENIZERS = frozenset({"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"})
_TEXT_DROPPING_BEHAVIOR = "removed"


class TokenLowerBound:
    """Built once per tokenizer (it reads the vocabulary); `at_least(text)` costs one pass of the normalizer."""

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        vocabulary = tokenizer.get_vocab() if backend is not None else {}
        self.longest_entry_chars = max((len(entry) for entry in vocabulary), default=0)
        self.trusted = (backend is not None and self.longest_entry_chars > 0 and _keeps_all_text(backend))

    def at_least(self, text: str) -> int:
        """Tokens `text` needs at least (0 when this tokenizer gives no usable bound)."""
        if not self.trusted or not text:
            return 0
        normalized = self._normalizer.normalize_str(text) if self._normalizer is not None else text
        return math.ceil(len(normalized) / self.longest_entry_chars)


def _keeps_all_text(backend: Any) -> bool:
    """Whether no pre-tokenizer and no model of this fast tokenizer drops characters."""
    if type(backend.model).__name__ == "WordPiece":  # an over-long word becomes one [UNK]
        return False
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is None:
        return True
    try:
        described = json.loads(pre_tokenizer.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False  # cannot tell: do not trust the bound
    return not _drops_text(described)


def _drops_text(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") in _TEXT_DROPPING_PRE_TOKENIZERS:
            return True
        if str(node.get("behavior", "")).lower() == _TEXT_DROPPING_BEHAVIOR:
            return True
        return any(_drops_text(value) for value in node.values())
    if isinstance(node, list):
        return any(_drops_text(item) for item in node)
    return False
