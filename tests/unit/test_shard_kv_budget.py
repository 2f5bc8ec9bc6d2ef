"""A shard's KV budget left at its default: no more than its streams' sessions at the model's whole context need in
its layers, so a small range of a small model does not reserve (and advertise, and count against max_memory_mb) the
1 GB default; a budget the operator set is kept, and `hearth host`'s cap of the default stays a default."""

from __future__ import annotations

import asyncio

import torch
from gguf import GGMLQuantizationType

from hearth.inference.memory import full_context_session_kv_bytes, megabytes
from hearth.services.common.config import HearthSettings, load_settings
from hearth.services.common.config_processes import ShardSettings
from hearth.services.host.main import with_memory_budget
from hearth.services.shard.main import load_shard

from .gguf_files import own_cache, tiny_gguf  # noqa: F401  (fixtures)
from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

TINY_CONTEXT = 256  # inference_tiny_models' max_position_embeddings


async def _loaded(path, settings: HearthSettings, lo: int, hi: int):
    return await load_shard(model=str(path), lo=lo, hi=hi, node="n", settings=settings, model_id=None, device="cpu",
                            dtype="fp32", stop_event=asyncio.Event())


async def test_a_default_budget_is_what_the_streams_full_context_sessions_need_and_is_advertised(tiny_model_dir):
    path = tiny_model_dir("llama")
    settings = HearthSettings()
    loaded = await _loaded(path, settings, 0, 1)
    try:
        runner = loaded.runner
        session_bytes = runner.session_kv_bytes(TINY_CONTEXT, (0, 1))
        expected = settings.shard.max_concurrent_streams * session_bytes
        assert expected < settings.shard.kv_cache_budget_bytes
        assert runner.cache_budget_bytes == expected
        assert loaded.identity.kv_cache_budget_mb == megabytes(expected)
        assert loaded.identity.memory_required_mb == megabytes(runner.weight_bytes + expected)
    finally:
        loaded.runner.close()


async def test_a_small_memory_limit_the_default_reserve_overran_now_serves_a_small_range(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    config = tmp_path / "hearth.toml"
    config.write_text("[shard]\nmax_memory_mb = 2\nmax_concurrent_streams = 2\n")
    settings = load_settings(config)
    loaded = await _loaded(path, settings, 0, 2)
    try:
        assert loaded.runner.cache_budget_bytes == 2 * loaded.runner.session_kv_bytes(TINY_CONTEXT, (0, 2))
        assert loaded.identity.memory_required_mb <= 2
    finally:
        loaded.runner.close()


async def test_a_budget_the_operator_set_is_kept(tiny_model_dir, tmp_path, monkeypatch):
    path = tiny_model_dir("llama")
    monkeypatch.setenv("HEARTH_SHARD__KV_CACHE_BUDGET_MB", "3")
    (tmp_path / "hearth.toml").write_text("[shard]\nmax_concurrent_streams = 2\n")
    settings = load_settings(tmp_path / "hearth.toml")
    loaded = await _loaded(path, settings, 0, 1)
    try:
        assert (loaded.runner.cache_budget_bytes, loaded.identity.kv_cache_budget_mb) == (3 * 2**20, 3.0)
    finally:
        loaded.runner.close()


def test_the_rule_takes_the_smaller_and_keeps_the_configured_budget_when_the_context_is_unknown():
    shard = ShardSettings(max_concurrent_streams=3)
    assert "kv_cache_budget_mb" not in shard.model_fields_set
    assert shard.shard_kv_budget_bytes(1000) == 3000
    assert shard.shard_kv_budget_bytes(10 * 2**30) == shard.kv_cache_budget_bytes
    assert shard.shard_kv_budget_bytes(None) == shard.kv_cache_budget_bytes
    assert ShardSettings(kv_cache_budget_mb=500).shard_kv_budget_bytes(1000) == 500 * 2**20


def test_the_hosts_cap_of_the_default_is_still_a_default_but_an_operators_budget_is_not():
    capped = with_memory_budget(HearthSettings(), 100).shard
    assert capped.kv_cache_budget_mb == 25 and capped.max_memory_mb == 100
    assert capped.shard_kv_budget_bytes(1000) == capped.max_concurrent_streams * 1000
    assert capped.shard_kv_budget_bytes(None) == 25 * 2**20
    chosen = HearthSettings(shard=ShardSettings(kv_cache_budget_mb=2))
    assert with_memory_budget(chosen, 100).shard.shard_kv_budget_bytes(1000) == 2 * 2**20


def test_the_full_context_session_is_read_from_the_config(tiny_model_dir):
    path = tiny_model_dir("llama")
    # 2 KV heads of 16 dimensions (64 hidden / 4 heads), keys and values, 2 bytes each in bf16.
    assert full_context_session_kv_bytes(path, 1, 3, torch.bfloat16) == TINY_CONTEXT * 2 * 2 * 16 * 2 * 3


def test_a_gguf_files_full_context_session_is_read_from_its_metadata(tiny_gguf):
    gguf_path, reference_folder = tiny_gguf("llama", GGMLQuantizationType.Q8_0)
    from_metadata = full_context_session_kv_bytes(gguf_path, 0, 1, torch.float32)
    assert from_metadata and from_metadata == full_context_session_kv_bytes(reference_folder, 0, 1, torch.float32)
