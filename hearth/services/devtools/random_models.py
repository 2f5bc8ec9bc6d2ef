"""Randomly initialised Llama checkpoints of named shapes (`random:<shape>`), written once to a cache folder.

`hearth bench`, `hearth demo --model random:<shape>` and the scripts under scripts/ run on them: each is
written with save_pretrained to ``$HEARTH_CACHE_DIR`` (default ~/.cache/hearth)/random-models/<shape>,
with a word-level tokenizer (token i is the word ``t<i>``) so prompts have exactly the requested length
and no end-of-sequence token, so every generation runs to its full length.

The highest ids are not words: the printable ASCII characters, space and newline (so that a grammar can spell JSON
with them, docs/gateway.md "Structured output") and the two control tokens of a minimal ChatML chat template with a
tools section (RANDOM_CHAT_TEMPLATE), so chat features are testable without a trained model. A word is decoded
with a space before it, a character without; an unknown word encodes as ``t0``.

A checkpoint is written into a staging folder beside its own (``<shape>.writing-<host>-<pid>``, a new tokenizer into
``<shape>.tokenizer-<host>-<pid>``) and moved in whole; a stop or an error removes the staging folder, and one left
by a writer that could not (SIGKILL, a power cut) is removed by the next use of the cache on the same host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from hearth.formats.cache_layout import RANDOM_MARKER_FILE, RANDOM_MODELS_FOLDER, hearth_cache_dir
from hearth.services.common.child_processes import process_alive

RANDOM_SHAPES: dict[str, dict[str, int]] = {
    # ~271M parameters (205M in the layers); the shape of scripts/bench_inference_memory.py.
    "llama-250m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                       intermediate_size=2816, vocab_size=32000),
    # TinyLlama-1.1B's shape (1.1B parameters).
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=32000),
    # Llama-3-8B's shape (8.0B parameters; issue 14's GPU target). Written in bf16 (16 GB), see BIG_SHAPES.
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    # For tests of the bench itself: seconds to write and run.
    "tiny": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
# Shapes written in bf16 and initialised tensor by tensor on the fastest device at hand: in fp32 through
# transformers' init, Llama-3-8B would need 32 GB of memory and of disk.
BIG_SHAPES = frozenset({"llama3-8b"})
random_init_std = 0.02  # LlamaConfig's initializer_range, what transformers' init draws linear weights with
RANDOM_PREFIX = "random:"
random_max_positions = 4096
random_init_seed = 0
# Raised when the tokenizer changes: a cached checkpoint with another version gets the new tokenizer (weights kept).
RANDOM_TOKENIZER_VERSION = 2
RANDOM_CHARACTERS = tuple(chr(code) for code in range(0x21, 0x7F)) + (" ", "\n")
RANDOM_CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>")
RANDOM_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- for message in messages if message.role == 'system' %}{{ message.content }}\n{% endfor -%}"
    "You may call these functions. To call one, answer only with a JSON object "
    "{\"name\": <function name>, \"arguments\": <arguments object>}.\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif -%}"
    "{%- for message in messages if not (tools and message.role == 'system') %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    "{\"name\": {{ call.function.name | tojson }}, \"arguments\": {{ call.function.arguments | tojson }}}"
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# A staging folder's name: what it is staging, its kind, the writer's host and process id; a name without the host is
# an older hearth's, written on this host (they were named so before the host was added).
STAGING_NAME = re.compile(r"(?P<shape>.+)\.(?:writing|tokenizer)-(?:(?P<host>.+)-)?(?P<pid>[0-9]+)")


class UnknownRandomShape(ValueError):
    """`random:<shape>` names no shape of RANDOM_SHAPES."""


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return hearth_cache_dir()


def random_checkpoint(spec: str, cache_dir: Path | None = None) -> Path:
    """The folder of `random:<shape>`, writing it (random fp32 weights + word-level tokenizer) on first use."""
    shape = spec.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        raise UnknownRandomShape(f"unknown random shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    folder = cache_root(cache_dir) / RANDOM_MODELS_FOLDER / shape
    remove_abandoned_staging(folder.parent)
    dims = RANDOM_SHAPES[shape]
    marker = folder / RANDOM_MARKER_FILE
    if marker.is_file():
        written = json.loads(marker.read_text())
        if written.get("tokenizer") != RANDOM_TOKENIZER_VERSION:
            # Written beside the folder and moved in file by file: a reader sees whole files, old or new.
            staging = _staging_folder(folder, "tokenizer")
            shutil.rmtree(staging, ignore_errors=True)
            write_random_tokenizer(staging, dims["vocab_size"])
            for written_file in staging.iterdir():
                os.replace(written_file, folder / written_file.name)
            staging.rmdir()
            marker.write_text(json.dumps({**written, "tokenizer": RANDOM_TOKENIZER_VERSION}))
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dims, max_position_embeddings=random_max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    staging = _staging_folder(folder, "writing")
    shutil.rmtree(staging, ignore_errors=True)
    print(f"writing random checkpoint {spec} to {folder} (once) ...", file=sys.stderr, flush=True)
    try:
        torch.manual_seed(random_init_seed)
        model = (random_bf16_llama(config) if shape in BIG_SHAPES
                 else LlamaForCausalLM(config).to(torch.float32).eval())
        model.save_pretrained(staging)
        del model
        write_random_tokenizer(staging, dims["vocab_size"])
        (staging / RANDOM_MARKER_FILE).write_text(json.dumps({"shape": shape, **dims, "seed": random_init_seed,
                                                              "tokenizer": RANDOM_TOKENIZER_VERSION}))
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    except BaseException:  # a stop (Ctrl-C) or a full disk midway: no half-written gigabytes left in the cache
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def staging_host() -> str:
    """This host's name as staging folders carry it (characters a folder name takes, no separator)."""
    return re.sub(r"[^\w.-]", "_", socket.gethostname()) or "localhost"


def _staging_folder(folder: Path, kind: str) -> Path:
    return folder.with_name(f"{folder.name}.{kind}-{staging_host()}-{os.getpid()}")


def remove_abandoned_staging(models: Path) -> list[Path]:
    """Remove the staging folders in `models` whose writer, a process of this host, has ended (SIGKILL, a power cut);
    the removed. One of a live process (or of a reused id) and one of another host sharing the cache are left."""
    removed = []
    try:
        entries = list(models.iterdir())
    except OSError:  # no cache yet (or none readable): nothing to remove
        return removed
    host = staging_host()
    for entry in entries:
        found = STAGING_NAME.fullmatch(entry.name)
        if found is None or found["host"] not in (None, host) or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(found["pid"])
        if pid > 0 and pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def write_random_tokenizer(folder: Path, vocab_size: int) -> None:
    """The word-level tokenizer of a random checkpoint (see the module's docstring), saved into `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    first_character = vocab_size - len(RANDOM_CHARACTERS) - len(RANDOM_CONTROL_TOKENS)
    vocab = {f"t{index}": index for index in range(first_character)}
    vocab.update({character: first_character + offset for offset, character in enumerate(RANDOM_CHARACTERS)})
    word_tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    word_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A word gets a space before it (dropped at the start of a text), a character none.
    word_tokenizer.decoder = decoders.Sequence([decoders.Replace(Regex("^t(?=[0-9])"), "\u2581t"),
                                                decoders.Metaspace(replacement="\u2581", prepend_scheme="always")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer, unk_token="t0")
    tokenizer.add_special_tokens({"additional_special_tokens": list(RANDOM_CONTROL_TOKENS)})
    tokenizer.chat_template = RANDOM_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def random_bf16_llama(config):
    """A bf16 LlamaForCausalLM with transformers' Llama init (normal weights, unit norms), built on the meta device
    and filled tensor by tensor, so the only memory it takes is its bf16 weights (on CUDA when torch sees one)."""
    import torch
    from transformers import LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    # Only the saved weights are filled: non-persistent buffers (the rotary inv_freq) stay unset, and are not saved.
    model = model.to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(random_init_seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, random_init_std, generator=generator)
    return model.to("cpu") if device.type != "cpu" else model
