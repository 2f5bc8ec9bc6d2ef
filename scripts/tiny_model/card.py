"""The bundled model's card (models/hearth-tiny-llama/README.md), filled in from one training run."""

MODEL_CARD = """\
# hearth-tiny-llama

A tiny Llama model bundled with hearth so that `hearth demo` and the tests can stream readable English
without any network access. It is a toy: it answers every message with something that reads like a
fortune cookie, often nonsensical, and knows nothing. Do not use it for anything but demos and tests.

## Architecture

| | |
|---|---|
| class | `LlamaForCausalLM` (plain transformers, no custom code) |
| layers | {layers} (the demo splits them into shards of two) |
| hidden size / intermediate size | {hidden} / {intermediate} |
| attention heads / key-value heads | {heads} / {kv_heads} (grouped-query attention) |
| context | {context} positions, RoPE |
| vocabulary | {vocab} byte-level BPE tokens, untied input and output embeddings |
| parameters | {params:,} |
| dtype | float32, safetensors |
| size on disk | {size_mb:.1f} MB (weights, tokenizer, configs) |

The tokenizer is byte-level, so every string round-trips. Special tokens: `<|begin|>` (bos, added to
raw prompts), `<|end|>` (eos, ends every turn), `<|pad|>`, and the role markers `<|system|>`,
`<|user|>`, `<|assistant|>`. The chat template renders

```
<|begin|><|user|>
Tell me a fortune.<|end|>
<|assistant|>
```

for `apply_chat_template(messages, add_generation_prompt=True)`.

## Training data and licence

{fortunes} fortunes from Debian's `fortunes` and `fortunes-min` packages (files in
`/usr/share/games/fortunes`: {files}), filtered to prose and verse of at most {max_chars} characters.
The packages are in Debian main; `/usr/share/doc/fortunes/copyright` puts them under the BSD licence of
the Regents of the University of California (clause 3 deleted). Each fortune was used either as plain
text or, with probability {chat_fraction}, as the assistant's answer to a short request such as "Tell me a
fortune." or "Tell me something about science." (the topic is the fortune file's name).

## Training

{steps} steps of AdamW (peak learning rate {lr}, {warmup} warm-up steps, cosine decay), batches of
{batch} windows of {window} tokens, seed {seed}, torch threads: {threads}, deterministic torch algorithms.

| | |
|---|---|
| final training loss (mean of the last {log_every} steps) | {train_loss:.3f} |
| held-out loss ({val_windows} windows) | {val_loss:.3f} |

Greedy answer to "Tell me a fortune.":

```
{sample}
```

## Retrain

```sh
apt-get update && apt-get install -y fortunes-min fortunes
{command}
```

The same command on the same torch build and thread count reproduces the same tokenizer and weights;
`training_manifest.json` records the arguments, the sha256 of every corpus file and the library versions.
"""
