"""Benchmark prompts of an exact token length, the same text for generate() and for the pipeline."""

from __future__ import annotations

import json
from pathlib import Path

from hearth.services.devtools.random_models import RANDOM_MARKER_FILE

PROMPT_WORDS = (
    "hearth runs one language model across the machines of a community mesh so that nobody needs a large "
    "computer each machine holds a few layers and passes activations to the next one over the network "
    "while an orchestrator embeds the prompt samples every token and streams the answer back"
).split()


def build_prompt(tokenizer, model_path: Path, prompt_tokens: int, variant: int = 0) -> tuple[str, list[int]]:
    """Raw prompt text of (at most, and for random checkpoints exactly) `prompt_tokens` tokens, and its ids
    exactly as the orchestrator tokenizes a raw prompt; `variant` gives a different text of the same length."""
    if (model_path / RANDOM_MARKER_FILE).is_file():
        vocab_size = json.loads((model_path / RANDOM_MARKER_FILE).read_text())["vocab_size"]
        words = [f"t{(7919 * (index + 1000 * variant) + 13) % (vocab_size - 1) + 1}" for index in range(prompt_tokens)]
    else:
        start = (7 * variant) % len(PROMPT_WORDS)
        rotated = PROMPT_WORDS[start:] + PROMPT_WORDS[:start]
        words = (rotated * (prompt_tokens // len(rotated) + 2))[: prompt_tokens + 1]

    def ids_of(count: int) -> list[int]:
        return list(tokenizer(" ".join(words[:count]))["input_ids"])

    low, high = 1, len(words)
    while low < high:  # the most words whose tokens still fit
        middle = (low + high + 1) // 2
        if len(ids_of(middle)) <= prompt_tokens:
            low = middle
        else:
            high = middle - 1
    text = " ".join(words[:low])
    return text, ids_of(low)
