"""Grammar-constrained sampling with llguidance (BENCHMARKS.md, "Constrained output: grammar library"): a model's
token table for the grammar library, and GrammarState, one call's matcher that masks the logits of its next token
to those its grammar allows and follows the tokens the call keeps (rolled back when the call goes back).

The call's grammar ends it: once the matcher is stopped (what was generated is complete and nothing may follow,
e.g. the closing brace of a JSON object) the call finishes; a call that reaches `max_tokens` first ends `length`
with its output cut short (as OpenAI's API does), and one that samples an end-of-sequence token where the grammar
allows it ends `stop`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

# Bit i of a mask word allows token 32 * word + i. The mask is applied here rather than by llguidance.torch, whose
# import compiles its kernel with torch.compile: seconds of every orchestrator's start, and on a GPU machine it
# initialises CUDA in a process that later forks (the prefork launcher's children then cannot use CUDA).
_MASK_BITS = torch.arange(32, dtype=torch.int32)

# JSON without optional whitespace: a model that learnt nothing could otherwise pad the output with blanks forever.
COMPACT_JSON = {"whitespace_flexible": False}

_tables: "weakref.WeakKeyDictionary[object, dict[int, llguidance.LLTokenizer]]" = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


class GrammarError(ValueError):
    """A grammar the library cannot compile (or that no token of the model can satisfy); the message says why."""


def json_schema_grammar(schema: dict) -> str:
    """The grammar of compact JSON that validates against `schema`."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    except (ValueError, TypeError, RuntimeError) as error:
        raise GrammarError(str(error).splitlines()[0] if str(error) else type(error).__name__) from None


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError, RuntimeError) as error:
        raise GrammarError(str(error).splitlines()[0] if str(error) else type(error).__name__) from None


def token_table(tokenizer, vocab_size: int, eos_token_id: int | None) -> llguidance.LLTokenizer:
    """The grammar library's view of `tokenizer` for logits of `vocab_size` (kept per tokenizer: making it reads
    every token once). Byte-level and byte-fallback tokenizers are read as they are; any other (the word-level
    tokenizer of random test models) by each token's text decoded after a context token."""
    with _tables_lock:
        per_size = _tables.setdefault(tokenizer, {})
        table = per_size.get(vocab_size)
        if table is None:
            table = per_size[vocab_size] = _make_table(tokenizer, vocab_size, eos_token_id)
        return table


def _make_table(tokenizer, vocab_size: int, eos_token_id: int | None) -> llguidance.LLTokenizer:
    eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
    try:
        if eos is not None:
            return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError, TypeError):
        pass
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_DecodedTokens(tokenizer, vocab_size, eos)),
                                  n_vocab=vocab_size)


class _DecodedTokens:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes as they appear inside a text
    (decoded after a context token, so a word-level token keeps the space its decoder puts before it)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        # The unknown token is a word like any other for a word-level vocabulary (text may hold it).
        special = set(getattr(tokenizer, "all_special_ids", ())) - {getattr(tokenizer, "unk_token_id", None)}
        context = next(token_id for token_id in range(vocab_size) if token_id not in special)
        before = tokenizer.decode([context])
        tokens: list[bytes] = []
        for token_id in range(vocab_size):
            if token_id in special:
                tokens.append(b"")
                continue
            text = tokenizer.decode([context, token_id])
            tokens.append(text[len(before):].encode() if text.startswith(before) else text.encode())
        self.tokens = tokens
        self._by_bytes = {token: token_id for token_id, token in reversed(list(enumerate(tokens))) if token}
        self._longest = max(map(len, self._by_bytes), default=1)
        # A token no text is made of stands for the end when the model has none (the grammar ends a call itself).
        self.eos_token_id = eos_token_id if eos_token_id is not None else (sorted(special) or [vocab_size - 1])[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(special | {self.eos_token_id})

    def __call__(self, text: str | bytes) -> list[int]:
        """Greedy longest-match tokens of `text` (what the grammar library asks for the bytes it forces)."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        ids: list[int] = []
        position = 0
        while position < len(data):
            for length in range(min(self._longest, len(data) - position), 0, -1):
                token_id = self._by_bytes.get(data[position:position + length])
                if token_id is not None:
                    ids.append(token_id)
                    position += length
                    break
            else:
                position += 1  # a byte no token spells: nothing can stand for it
        return ids


class GrammarState:
    """One call's matcher over its generated tokens (read, never copied: the call's own list): `mask` forbids what
    the grammar does not allow next, `follow` brings the matcher to the tokens the call holds now (consuming new
    ones, rolling back withdrawn ones), `stopped` says the output is complete. The grammar is compiled at the first
    of these (on the compute thread, where `mask` runs), or by `compile`."""

    def __init__(self, table: llguidance.LLTokenizer, grammar: str, generated: Sequence[int]) -> None:
        self._table = table
        self._grammar = grammar
        self._matcher: llguidance.LLMatcher | None = None
        self._generated = generated
        self._consumed = 0
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, table.vocab_size)

    def compile(self) -> llguidance.LLMatcher:
        """The matcher (compiled now if it was not yet); GrammarError when the grammar cannot be compiled."""
        if self._matcher is None:
            matcher = llguidance.LLMatcher(self._table, self._grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(matcher.get_error().splitlines()[0])
            self._matcher = matcher
        return self._matcher

    def follow(self) -> None:
        """Match the call's generated tokens: roll back those it no longer holds, consume those it added."""
        matcher = self.compile()
        held = len(self._generated)
        if self._consumed > held:
            if not matcher.rollback(self._consumed - held):
                raise GrammarError(f"the grammar cannot go back to token {held}: {matcher.get_error()}")
            self._consumed = held
        for token_id in self._generated[self._consumed:]:
            if not matcher.consume_token(int(token_id)):
                raise GrammarError(f"token {token_id} breaks the grammar: {matcher.get_error()}")
            self._consumed += 1

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` ``[vocab]`` (float32, CPU) with every token the grammar forbids next at -inf."""
        self.follow()
        llguidance.numpy.fill_next_token_bitmask(self.compile(), self._bitmask, 0)
        masked = scores.detach().to(device="cpu", dtype=torch.float32).clone()
        words = torch.from_numpy(self._bitmask[0])
        allowed = ((words.unsqueeze(-1) >> _MASK_BITS) & 1).flatten().bool()
        vocab = masked.shape[-1]
        if vocab > allowed.numel():  # tokens beyond the grammar's table: never allowed
            masked[allowed.numel():] = float("-inf")
        masked[:allowed.numel()].masked_fill_(~allowed[:vocab], float("-inf"))
        return masked

    @property
    def stopped(self) -> bool:
        """The output so far is complete and nothing may follow it."""
        return self.compile().is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is complete (more may still follow)."""
        return self.compile().is_accepting()
