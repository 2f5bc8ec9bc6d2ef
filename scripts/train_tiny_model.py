"""Trains the small bundled Llama model (models/hearth-tiny-llama) and its tokenizer from Debian's fortunes.

The offline demo needs a model that writes readable English without any network access, small enough
to live in the repository (< 25 MB) and deep enough (6 layers) to be split into three shards of two.
This script builds it from scratch, reproducibly, on a CPU:

1. reads the fortune cookie files of Debian's ``fortunes`` and ``fortunes-min`` packages (BSD licence,
   Debian main), splits them into fortunes and filters out ASCII art and code;
2. trains a byte-level BPE tokenizer (any text round-trips) with chat special tokens
   (``<|begin|>``, ``<|end|>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|pad|>``) and a
   chat template;
3. formats every fortune either as a chat exchange ("Tell me something about science." ->
   the fortune) or as plain text, packs the token stream into fixed windows and trains a
   ``LlamaForCausalLM`` with AdamW;
4. saves model (safetensors), tokenizer, generation config, a training manifest and a model card.

Install the corpus (Debian/Ubuntu, as root)::

    apt-get update && apt-get install -y fortunes-min fortunes
    # the files land in /usr/share/games/fortunes, the licence in /usr/share/doc/fortunes/copyright

Retrain the bundled model (about 20 minutes on one otherwise idle CPU core)::

    .venv/bin/python scripts/train_tiny_model.py --word-list-out tests/unit/data/fortune_words.txt

(``--word-list-out`` refreshes the corpus word list that tests/unit/test_bundled_model.py checks
answers against; it depends only on the corpus and the filter, not on training.)

Reproducibility: data order, initialisation and sampling of chat prompts come from ``--seed``, torch
runs with deterministic algorithms and a fixed thread count (``--threads``), so the same arguments on the
same torch build give the same tokenizer and the same weights. A different thread count or torch build
may change floating-point reduction order and therefore the last bits of the weights. The default is
one thread: it makes the weights independent of the machine's core count, and on a machine whose cores
are shared, two threads waiting on each other ran more than ten times slower than one.
"""

from __future__ import annotations

import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated

# First: tiny_model.tokenizer pins the tokenizer's thread pool before anything imports `tokenizers`.
from tiny_model.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    build_sample_texts,
    encode_samples,
    train_tokenizer,
    wrap_tokenizer,
)

import torch  # noqa: E402
import typer  # noqa: E402
from tiny_model.card import MODEL_CARD  # noqa: E402
from tiny_model.corpus import (  # noqa: E402
    DEFAULT_CORPUS_DIR,
    DEFAULT_CORPUS_FILES,
    corpus_digest,
    load_fortunes,
    write_word_list,
)
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "models" / "hearth-tiny-llama"
MODEL_SIZE_LIMIT_BYTES = 25 * 1024 * 1024


def pack_epoch(samples: list[list[int]], window_tokens: int, rng: random.Random) -> torch.Tensor:
    """Shuffles the samples, concatenates them and cuts the stream into windows of window_tokens."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    stream = [token for index in order for token in samples[index]]
    windows = len(stream) // window_tokens
    return torch.tensor(stream[: windows * window_tokens], dtype=torch.long).view(windows, window_tokens)


def learning_rate(step: int, total_steps: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over the given windows (the held-out set)."""
    model.eval()
    losses = []
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        losses.append(model(input_ids=batch, labels=batch).loss.item() * len(batch))
    model.train()
    return sum(losses) / len(windows)


def greedy_chat(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, tokens: int) -> str:
    """The model's greedy answer to one user message, as the demo would show it."""
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    model.eval()
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def directory_size_bytes(path: Path) -> int:
    """Bytes of all files below path."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def main(
    corpus_dir: Annotated[
        Path, typer.Option(help="Folder with the fortune files (Debian: /usr/share/games/fortunes).")
    ] = DEFAULT_CORPUS_DIR,
    out: Annotated[Path, typer.Option(help="Output folder for model, tokenizer and model card.")] = DEFAULT_OUT_DIR,
    files: Annotated[str, typer.Option(help="Comma-separated fortune files to train on, in this order.")] = ",".join(
        DEFAULT_CORPUS_FILES
    ),
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 2000,
    batch_size: Annotated[int, typer.Option(help="Windows per batch.")] = 8,
    window_tokens: Annotated[int, typer.Option(help="Tokens per training window.")] = 256,
    peak_lr: Annotated[float, typer.Option(help="Peak learning rate of AdamW.")] = 2e-3,
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 100,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay on matrices.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed for data order, chat prompts and initialisation.")] = 1234,
    threads: Annotated[int, typer.Option(help="torch CPU threads; part of what makes a run reproducible.")] = 1,
    vocab_size: Annotated[int, typer.Option(help="BPE vocabulary size including special tokens.")] = 2048,
    hidden_size: Annotated[int, typer.Option(help="Model width.")] = 256,
    intermediate_size: Annotated[int, typer.Option(help="MLP width.")] = 768,
    layers: Annotated[int, typer.Option(help="Decoder layers (the demo needs 6 for three shards of two).")] = 6,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key-value heads (grouped-query attention).")] = 2,
    context_tokens: Annotated[int, typer.Option(help="max_position_embeddings of the model.")] = 512,
    chat_fraction: Annotated[float, typer.Option(help="Share of fortunes formatted as chat exchanges.")] = 0.5,
    max_fortune_chars: Annotated[int, typer.Option(help="Longer fortunes are left out.")] = 600,
    val_fraction: Annotated[float, typer.Option(help="Share of windows held out for the validation loss.")] = 0.02,
    log_every: Annotated[int, typer.Option(help="Print progress every this many steps.")] = 50,
    word_list_out: Annotated[
        Path | None, typer.Option(help="Also write the corpus word list used by tests/unit/test_bundled_model.py.")
    ] = None,
) -> None:
    """Train the bundled tiny Llama model and tokenizer on Debian's fortunes, reproducibly, on CPU."""
    started = time.monotonic()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    rng = random.Random(seed)

    file_names = [name.strip() for name in files.split(",") if name.strip()]
    fortunes = load_fortunes(corpus_dir, file_names, max_fortune_chars)
    print(f"corpus: {len(fortunes)} fortunes from {len(file_names)} files in {corpus_dir}", flush=True)
    if word_list_out is not None:
        count = write_word_list(fortunes, word_list_out, min_count=3)
        print(f"word list: {count} words -> {word_list_out}", flush=True)

    tokenizer = train_tokenizer([fortune.text for fortune in fortunes], vocab_size)
    hf_tokenizer = wrap_tokenizer(tokenizer, context_tokens)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens", flush=True)

    samples = encode_samples(tokenizer, build_sample_texts(fortunes, chat_fraction, rng))
    total_tokens = sum(len(sample) for sample in samples)
    # Held-out samples are chosen once, so validation never sees a training fortune.
    val_count = max(1, int(len(samples) * val_fraction))
    split_order = list(range(len(samples)))
    rng.shuffle(split_order)
    val_samples = [samples[index] for index in split_order[:val_count]]
    train_samples = [samples[index] for index in split_order[val_count:]]
    val_windows = pack_epoch(val_samples, window_tokens, rng)
    print(
        f"data: {total_tokens} tokens, {len(train_samples)} training and {len(val_samples)} held-out samples",
        flush=True,
    )

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context_tokens,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
    )
    model = LlamaForCausalLM(config)
    model.train()
    parameter_count = sum(parameter.numel() for parameter in model.parameters())
    print(f"model: {parameter_count:,} parameters", flush=True)

    decay = [p for name, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for name, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )

    epoch_windows = pack_epoch(train_samples, window_tokens, rng)
    cursor = 0
    epoch = 0
    recent_losses: list[float] = []
    for step in range(steps):
        if cursor + batch_size > len(epoch_windows):
            epoch += 1
            epoch_windows = pack_epoch(train_samples, window_tokens, rng)
            cursor = 0
        batch = epoch_windows[cursor : cursor + batch_size]
        cursor += batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr, warmup_steps)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent_losses = (recent_losses + [loss.item()])[-log_every:]
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed_s = time.monotonic() - started
            eta_s = elapsed_s / (step + 1) * (steps - step - 1)
            print(
                f"step {step + 1}/{steps} epoch {epoch} loss {sum(recent_losses) / len(recent_losses):.3f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} elapsed {elapsed_s:.0f}s eta {eta_s:.0f}s",
                flush=True,
            )

    train_loss = sum(recent_losses) / len(recent_losses)
    val_loss = mean_loss(model, val_windows, batch_size)
    print(f"final: train loss {train_loss:.3f}, held-out loss {val_loss:.3f}", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
    sample = greedy_chat(model, hf_tokenizer, "Tell me a fortune.", tokens=48)
    print(f"sample: {sample!r}", flush=True)

    arguments = {
        "files": files,
        "steps": steps,
        "batch_size": batch_size,
        "window_tokens": window_tokens,
        "peak_lr": peak_lr,
        "warmup_steps": warmup_steps,
        "weight_decay": weight_decay,
        "seed": seed,
        "threads": threads,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "context_tokens": context_tokens,
        "chat_fraction": chat_fraction,
        "max_fortune_chars": max_fortune_chars,
        "val_fraction": val_fraction,
    }
    manifest = {
        "arguments": arguments,
        "corpus_dir": str(corpus_dir),
        "corpus_sha256": corpus_digest(corpus_dir, file_names),
        "fortunes": len(fortunes),
        "corpus_tokens": total_tokens,
        "parameters": parameter_count,
        "final_train_loss": round(train_loss, 4),
        "held_out_loss": round(val_loss, 4),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
    }
    (out / "training_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    command = " ".join([".venv/bin/python scripts/train_tiny_model.py", *map(shlex.quote, sys.argv[1:])])
    files_size_bytes = sum(file.stat().st_size for file in out.iterdir() if file.is_file() and file.name != "README.md")
    card = MODEL_CARD.format(
        layers=layers,
        hidden=hidden_size,
        intermediate=intermediate_size,
        heads=heads,
        kv_heads=kv_heads,
        context=context_tokens,
        vocab=tokenizer.get_vocab_size(),
        params=parameter_count,
        size_mb=files_size_bytes / 1e6,
        fortunes=len(fortunes),
        files=", ".join(file_names),
        max_chars=max_fortune_chars,
        chat_fraction=chat_fraction,
        steps=steps,
        lr=peak_lr,
        warmup=warmup_steps,
        batch=batch_size,
        window=window_tokens,
        seed=seed,
        threads=threads,
        log_every=log_every,
        train_loss=train_loss,
        val_loss=val_loss,
        val_windows=len(val_windows),
        sample=sample,
        command=command,
    )
    (out / "README.md").write_text(card, encoding="utf-8")

    size_bytes = directory_size_bytes(out)
    print(f"saved to {out}: {size_bytes / 1e6:.1f} MB in {time.monotonic() - started:.0f}s", flush=True)
    if size_bytes > MODEL_SIZE_LIMIT_BYTES:
        print(f"warning: {out} is larger than the {MODEL_SIZE_LIMIT_BYTES} bytes allowed in the repository")


if __name__ == "__main__":
    typer.run(main)
