"""Measures the grammar libraries hearth could constrain output with (llguidance, xgrammar, outlines-core): the time
to prepare a tokenizer, to compile a JSON schema, and to compute one step's token mask, on the bundled toy model's
tokenizer and on SmolLM2-135M's (its GGUF's), walking each grammar with random logits as a model that has learnt
nothing would. Prints a Markdown table (BENCHMARKS.md, "Constrained output: grammar library").

    .venv/bin/python scripts/bench_grammar.py [--steps 200] [--repeats 3]

A library that is not installed is skipped (xgrammar: `pip install --no-deps xgrammar apache-tvm-ffi` measures it
without the triton it requires on Linux).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "member", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def tokenizers() -> dict[str, object]:
    from transformers import AutoTokenizer

    from hearth.inference.gguf_checkpoint import load_gguf_tokenizer
    from hearth.services.devtools.demo_model import bundled_model_path, real_demo_model_path

    found = {"toy (hearth-tiny-llama)": AutoTokenizer.from_pretrained(bundled_model_path())}
    gguf = real_demo_model_path()
    if gguf is not None:
        found["SmolLM2-135M (GGUF)"] = load_gguf_tokenizer(gguf)
    return found


class Llguidance:
    name = "llguidance"

    def prepare(self, tokenizer, vocab_size):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, prepared, schema):
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        return llguidance.LLMatcher(prepared, grammar)

    def walker(self, prepared, compiled, vocab_size):
        import llguidance.torch as llg_torch

        mask = llg_torch.allocate_token_bitmask(1, vocab_size)
        matcher = compiled

        def step(logits):
            llg_torch.fill_next_token_bitmask(matcher, mask, 0)
            llg_torch.apply_token_bitmask_inplace(logits, mask)
            return logits

        return step, matcher.consume_token, matcher.is_stopped


class Xgrammar:
    name = "xgrammar"

    def prepare(self, tokenizer, vocab_size):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        return xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, prepared, schema):
        return prepared.compile_json_schema(json.dumps(schema))

    def walker(self, prepared, compiled, vocab_size):
        import xgrammar

        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, vocab_size)

        def step(logits):
            matcher.fill_next_token_bitmask(mask)
            xgrammar.apply_token_bitmask_inplace(logits, mask)
            return logits

        return step, matcher.accept_token, matcher.is_terminated


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as in a token's string."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


class OutlinesCore:
    name = "outlines-core"

    def prepare(self, tokenizer, vocab_size):
        from outlines_core import Vocabulary

        to_byte = {char: byte for byte, char in byte_level_alphabet().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for token, token_id in tokenizer.get_vocab().items():
            if token_id in special or token_id >= vocab_size:
                continue
            tokens.setdefault(bytes(to_byte.get(char, 0) for char in token), []).append(token_id)
        return Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, prepared, schema):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), prepared)

    def walker(self, prepared, compiled, vocab_size):
        from outlines_core import Guide

        guide = Guide(compiled)

        def step(logits):
            allowed = torch.zeros(vocab_size, dtype=torch.bool)
            allowed[torch.as_tensor(guide.get_tokens(), dtype=torch.long)] = True
            return logits.masked_fill_(~allowed, float("-inf"))

        return step, guide.advance, guide.is_finished


def measure(library, tokenizer, steps: int, repeats: int, seed: int) -> dict[str, float] | None:
    vocab_size = len(tokenizer)
    started = time.perf_counter()
    prepared = library.prepare(tokenizer, vocab_size)
    prepare_s = time.perf_counter() - started
    compile_times, mask_times = [], []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(repeats):
        started = time.perf_counter()
        compiled = library.compile(prepared, SCHEMA)
        compile_times.append(time.perf_counter() - started)
        step, consume, finished = library.walker(prepared, compiled, vocab_size)
        for _ in range(steps):
            logits = torch.randn(1, vocab_size, generator=generator)
            started = time.perf_counter()
            masked = step(logits)
            mask_times.append(time.perf_counter() - started)
            token = int(torch.argmax(masked))
            consume(token)
            if finished():
                break
    return {"prepare_s": prepare_s, "compile_ms": statistics.median(compile_times) * 1000,
            "mask_us": statistics.median(mask_times) * 1e6, "steps": len(mask_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="grammar steps per walk at most")
    parser.add_argument("--repeats", type=int, default=3, help="walks (and schema compiles) per library and tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {platform.processor() or platform.system()}, torch threads 1")
    print("| library | tokenizer | vocab | prepare tokenizer (s) | compile schema (ms) | mask per token (µs) | "
          "steps |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for tokenizer_name, tokenizer in tokenizers().items():
        for library in (Llguidance(), Xgrammar(), OutlinesCore()):
            try:
                result = measure(library, tokenizer, args.steps, args.repeats, args.seed)
            except ImportError as error:
                print(f"| {library.name} | {tokenizer_name} | not installed ({error.name}) | | | | |")
                continue
            print(f"| {library.name} | {tokenizer_name} | {len(tokenizer)} | {result['prepare_s']:.2f} | "
                  f"{result['compile_ms']:.1f} | {result['mask_us']:.0f} | {result['steps']} |", flush=True)


if __name__ == "__main__":
    main()
