"""`hearth host --memory-budget-mb`: the budget becomes the host's `[shard] max_memory_mb`, and a KV reserve left at
its default is capped to a share of it so that a small budget still holds layers; an explicit reserve is kept."""

from __future__ import annotations

import pytest

from hearth.services.common.config import HearthSettings
from hearth.services.host.main import DEFAULT_KV_RESERVE_MAX_BUDGET_SHARE, with_memory_budget

KV_ENV = "HEARTH_SHARD__KV_CACHE_BUDGET_MB"


def host_of(settings: HearthSettings):
    return settings.shard


def test_a_small_budget_caps_the_default_kv_reserve_to_its_share(monkeypatch):
    monkeypatch.delenv(KV_ENV, raising=False)
    host = host_of(with_memory_budget(HearthSettings(), 500))
    assert host.max_memory_mb == 500
    assert host.kv_cache_budget_mb == pytest.approx(DEFAULT_KV_RESERVE_MAX_BUDGET_SHARE * 500)


def test_a_large_budget_keeps_the_default_kv_reserve(monkeypatch):
    monkeypatch.delenv(KV_ENV, raising=False)
    default = host_of(HearthSettings()).kv_cache_budget_mb
    host = host_of(with_memory_budget(HearthSettings(), 100 * default))
    assert host.kv_cache_budget_mb == default


def test_an_explicit_kv_reserve_is_kept_even_when_it_fills_the_budget(monkeypatch):
    monkeypatch.setenv(KV_ENV, "450")
    host = host_of(with_memory_budget(HearthSettings(), 500))
    assert host.max_memory_mb == 500 and host.kv_cache_budget_mb == 450


def test_no_budget_leaves_the_settings_alone(monkeypatch):
    monkeypatch.delenv(KV_ENV, raising=False)
    settings = HearthSettings()
    assert with_memory_budget(settings, None) is settings


@pytest.mark.parametrize("budget", ["inf", "1e400", "nan", "0", "4GB"])
def test_a_budget_that_is_no_finite_positive_number_is_refused_by_the_command_line(budget):
    """Before, "inf" (or a number too large for a float) passed the option's check and the host failed with an
    OverflowError traceback once it turned the budget into bytes."""
    from typer.testing import CliRunner

    from hearth.services.cli import app

    result = CliRunner().invoke(app, ["host", "--model", "m", "--memory-budget-mb", budget, "--insecure",
                                      "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--memory-budget-mb'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["MAX_MEMORY_MB", "KV_CACHE_BUDGET_MB"])
def test_an_infinite_memory_setting_is_refused_as_configuration(monkeypatch, name):
    """An infinite `[shard] max_memory_mb` or `kv_cache_budget_mb` failed later as an OverflowError traceback."""
    from pydantic import ValidationError

    monkeypatch.setenv("HEARTH_SHARD__" + name, "inf")
    with pytest.raises(ValidationError, match="finite number"):
        HearthSettings()


def test_a_budget_that_holds_no_layer_is_refused_before_the_broker_is_dialled(monkeypatch):
    """No layer fits whatever the mesh serves, so the host says so at once: before, it dialled the broker first, and
    with none reachable (or none yet: --wait-for-nats) the budget's problem was never named."""
    import asyncio

    from hearth.services.host.main import run_host
    from hearth.services.shard.main import ShardRefused
    from tests.integration.tiny_shard_server import MODEL

    monkeypatch.delenv(KV_ENV, raising=False)
    with pytest.raises(ShardRefused, match=r"^a memory budget of 1\.0 MB holds no layer of hearth-tiny-llama: the "
                                           r"smallest needs 3\.0 MB plus 0\.25 MB kv_cache_budget_mb$"):
        asyncio.run(asyncio.wait_for(run_host(
            model=str(MODEL), memory_budget_mb=1.0, nats_url="nats://127.0.0.1:1", settings=HearthSettings(),
            node_id="n1", device="cpu", stop_event=asyncio.Event()), timeout=60))


def test_a_range_the_host_plans_within_its_budget_is_not_refused_by_the_rounded_figure():
    """The shard compared its need rounded to a thousandth of a MB with the budget: a range `hearth host` had chosen
    within its budget by bytes was refused once rounding carried it over (and chosen again on every restart)."""
    from hearth.inference.memory import MiB
    from hearth.services.shard.memory_plan import MemoryNeed, kv_reserve_bytes, refusal

    shard = HearthSettings().shard.model_copy(update={"max_memory_mb": 6.0006, "kv_cache_budget_mb": 1.0})
    weights_budget = int(shard.max_memory_mb * MiB) - kv_reserve_bytes(shard)  # as run_host plans it
    assert refusal(0, 1, MemoryNeed(weights_budget, kv_reserve_bytes(shard)), shard, measured=False) is None
    assert refusal(0, 1, MemoryNeed(weights_budget + 1, kv_reserve_bytes(shard)), shard, measured=False)


def test_the_plan_a_host_logs_names_its_range_what_it_weighs_against_its_budget_and_the_coverage_it_joined():
    """The line said "serving layers 0-1 of M in none (coverage: [0, 0, 0, 0, 0, 0])": one number per layer (eighty
    for a large model), and nothing of the budget the range was chosen within."""
    from hearth.inference.memory import MiB
    from hearth.services.host.main import plan_text
    from hearth.services.host.model_layout import ModelLayout
    from hearth.services.host.planner import LayerRange

    from hearth.inference.quantization import parse_quantization

    layout = ModelLayout(total_layers=6, layer_bytes=[MiB // 4] * 6, weights_sha256="00", served_id="tiny",
                         scheme=parse_quantization("int8"))
    assert plan_text("host-b", LayerRange(2, 3), layout, int(0.6 * MiB), [1, 1, 0, 0, 0, 0]) == (
        "host host-b: serving layers 2-3 of tiny in int8 (2 of its 6 layers, 0.5 MB of weights within 0.6 MB: the "
        "budget less the KV reserve); the mesh held: 0-1 x1, 2-5 MISSING")
