"""A shard's memory, accounted for and enforced: the need estimated from the checkpoint's headers equals what the
loaded range measures, a range that would not fit `[shard] max_memory_mb` (or its old name `shard_max_vram_mb`) is
refused naming both numbers before any weight is read, `serve_shards = false` refuses, and the advertisement says
where the shard computes. With static KV caches (a GPU's), a budget that holds no session is refused at start naming
both numbers, and a shard serves at most the sessions whose static caches its budget holds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hearth.inference import load_layer_range
from tests.runner_limits import SESSION_TTL_S
from hearth.services.common.config import load_settings
from hearth.services.shard.main import ShardRefused, load_shard, run_shard, static_cache_refusal, within_kv_budget
from hearth.services.shard.memory_plan import estimated_need, measured_need

from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

HOST = "[research.distributed_inference.host]\n"
SHARD = "[shard]\n"


def settings_with(tmp_path, lines: str, table: str = SHARD):
    path = tmp_path / "hearth.toml"
    path.write_text(table + lines)
    return load_settings(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_from_the_headers_is_what_the_loaded_range_holds(tiny_model_dir, tmp_path, dtype):
    path = tiny_model_dir("llama")
    shard = settings_with(tmp_path, "kv_cache_budget_mb = 2\n").shard
    estimate = estimated_need(path, 1, 3, dtype, shard)
    runner = load_layer_range(path, 1, 3, dtype=dtype, cache_budget_bytes=estimate.kv_reserve_bytes,
                              session_ttl_s=SESSION_TTL_S)
    measured = measured_need(runner, None)
    assert estimate == measured
    assert measured.weight_bytes == runner.weight_bytes and measured.kv_reserve_bytes == 2 * 2**20
    assert measured.required_mb == pytest.approx(runner.weight_bytes / 2**20 + 2, abs=1e-3)


async def test_a_range_that_does_not_fit_is_refused_naming_both_numbers(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    # The original specification's place and name work; 2 MB cannot hold a 1 MB KV reserve plus 6 layers of 0.14 MB.
    settings = settings_with(tmp_path, "shard_max_vram_mb = 1.5\nkv_cache_budget_mb = 1\n", HOST)
    assert settings.shard.max_memory_mb == 1.5
    with pytest.raises(ShardRefused) as refused:
        await load_shard(model=str(path), lo=0, hi=5, node="n", settings=settings, model_id=None, device="cpu",
                         dtype=None, stop_event=asyncio.Event())
    message = str(refused.value)
    assert "layers 0-5 would need 1.8 MB" in message and "[shard] max_memory_mb = 1.5 MB" in message
    # Two layers fit.
    loaded = await load_shard(model=str(path), lo=0, hi=1, node="n", settings=settings, model_id=None,
                              device="cpu", dtype="bf16", stop_event=asyncio.Event())
    identity = loaded.identity
    assert (identity.device_kind, identity.dtype, identity.kv_cache_budget_mb) == ("cpu", "bfloat16", 1.0)
    assert identity.memory_required_mb <= 1.5 and identity.device_name
    assert loaded.runner.cache_budget_bytes == 2**20
    loaded.runner.close()


async def test_serve_shards_false_refuses_and_so_does_a_device_that_is_not_here(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    with pytest.raises(ShardRefused, match="serve_shards = false"):
        await run_shard(model=str(path), layers="0-1", nats_url=None, stop_event=asyncio.Event(),
                        settings=settings_with(tmp_path, "serve_shards = false\n"))
    if not torch.cuda.is_available():
        with pytest.raises(ShardRefused, match="no CUDA device"):
            await load_shard(model=str(path), lo=0, hi=1, node="n", settings=load_settings(), model_id=None,
                             device="cuda", dtype=None, stop_event=asyncio.Event())


def test_backend_is_accepted_for_device(tmp_path):
    host = settings_with(tmp_path, 'backend = "cuda:1"\ndtype = "fp16"\n', HOST).research.distributed_inference.host
    assert (host.device, host.dtype) == ("cuda:1", "fp16")
    with pytest.raises(ValueError):
        settings_with(tmp_path, 'device = "gpu"\n', HOST)


STATIC_TOKENS = 64
ONE_STATIC_SESSION = STATIC_TOKENS * 3 * 2 * 2 * 16 * 4  # positions x layers x (K, V) x KV heads x head dim x fp32


def test_a_kv_budget_bounds_the_streams_of_a_shard_with_static_caches(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    settings = settings_with(tmp_path, "")
    assert settings.shard.max_concurrent_streams == 4
    # Static caches (what a GPU gets; eager here) of 64 positions over layers 0-2, and room for two and a half.
    runner = load_layer_range(path, 0, 2, static_cache_tokens=STATIC_TOKENS,
                              cache_budget_bytes=ONE_STATIC_SESSION * 5 // 2, session_ttl_s=SESSION_TTL_S)
    assert runner.static_session_bytes == ONE_STATIC_SESSION
    assert static_cache_refusal(runner, settings.shard) is None
    capped = within_kv_budget(settings, runner, "tiny:0-2@x")
    assert capped.shard.max_concurrent_streams == 2 and settings.shard.max_concurrent_streams == 4
    roomy = load_layer_range(path, 0, 2, static_cache_tokens=STATIC_TOKENS, cache_budget_bytes=ONE_STATIC_SESSION * 9,
                             session_ttl_s=SESSION_TTL_S)
    assert within_kv_budget(settings, roomy, "tiny:0-2@x") is settings
    dynamic = load_layer_range(path, 0, 2, cache_budget_bytes=ONE_STATIC_SESSION, session_ttl_s=SESSION_TTL_S)
    assert dynamic.static_session_bytes is None and within_kv_budget(settings, dynamic, "tiny:0-2@x") is settings


def test_a_kv_budget_that_holds_no_static_session_is_refused_naming_both_numbers(tiny_model_dir, tmp_path):
    shard = settings_with(tmp_path, "").shard
    runner = load_layer_range(tiny_model_dir("llama"), 0, 2, static_cache_tokens=STATIC_TOKENS,
                              cache_budget_bytes=ONE_STATIC_SESSION - 1, session_ttl_s=SESSION_TTL_S)
    reason = static_cache_refusal(runner, shard)
    assert reason is not None and "kv_cache_budget_mb" in reason and "layers 0-2" in reason
    assert f"({ONE_STATIC_SESSION} bytes:" in reason and f"({ONE_STATIC_SESSION - 1} bytes)" in reason
