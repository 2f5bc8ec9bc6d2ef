"""Random checkpoints of named shapes (hearth/services/devtools/random_models.py): the bf16 path for big shapes
(Llama-3-8B) gives transformers' Llama init in bf16 and a checkpoint hearth's loader reads; unknown shapes are refused
by name."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hearth.inference import load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.services.devtools.random_models import (
    BIG_SHAPES,
    RANDOM_SHAPES,
    UnknownRandomShape,
    random_bf16_llama,
    random_checkpoint,
    random_init_std,
)


def test_every_big_shape_is_a_known_shape():
    assert BIG_SHAPES <= set(RANDOM_SHAPES)
    assert RANDOM_SHAPES["llama3-8b"]["num_key_value_heads"] == 8


def test_unknown_shapes_are_refused_by_name(tmp_path):
    with pytest.raises(UnknownRandomShape, match="llama3-8b"):
        random_checkpoint("random:llama-7t", cache_dir=tmp_path)


def test_the_big_shape_path_writes_bf16_llama_init_that_the_loader_reads(tmp_path):
    config = LlamaConfig(**RANDOM_SHAPES["tiny"], max_position_embeddings=64, tie_word_embeddings=False)
    model = random_bf16_llama(config)
    weights = dict(model.named_parameters())
    assert {parameter.dtype for parameter in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
    projection = weights["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(projection.std().item() - random_init_std) < 0.1 * random_init_std
    model.save_pretrained(tmp_path)
    runner = load_layer_range(tmp_path, 0, 1, dtype="bfloat16", **RUNNER_KV_LIMITS)
    loaded = dict(runner.named_parameters())
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(loaded[name], weights[name])
    output = runner.forward("s", torch.randn(1, 3, config.hidden_size, dtype=torch.bfloat16), 0, "prefill")
    assert torch.isfinite(output.float()).all()


def test_staging_folders_of_writes_killed_on_this_host_are_removed_and_no_live_ones(tmp_path):
    """A write SIGKILLed (or cut by a power loss) leaves its staging folder; the next use of the cache removes those
    whose process is gone, never one of a process alive here, of another host (its process ids mean nothing here)
    or another name."""
    import json
    import subprocess

    from hearth.services.devtools import random_models
    from hearth.services.devtools.random_models import RANDOM_MARKER_FILE, RANDOM_TOKENIZER_VERSION

    ended = subprocess.Popen(["true"])
    ended.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        models = tmp_path / "random-models"
        (models / "tiny").mkdir(parents=True)
        (models / "tiny" / RANDOM_MARKER_FILE).write_text(json.dumps({"tokenizer": RANDOM_TOKENIZER_VERSION}))
        host = random_models.staging_host()
        gone = [f"tiny.writing-{ended.pid}", f"tiny.writing-{host}-{ended.pid}", f"tiny.tokenizer-{host}-{ended.pid}",
                f"llama-250m.writing-{host}-{ended.pid}"]
        kept = [f"tiny.writing-{host}-{alive.pid}", f"tiny.writing-{alive.pid}", f"tiny.writing-elsewhere-{ended.pid}",
                "tiny.notes", "tiny.writing-notes"]
        for name in gone + kept:
            (models / name).mkdir()
            (models / name / "model.safetensors").write_bytes(b"half")
        assert random_checkpoint("random:tiny", cache_dir=tmp_path) == models / "tiny"
        assert sorted(path.name for path in models.iterdir()) == sorted(["tiny", *kept])
    finally:
        alive.kill()
        alive.wait()
