"""Configuration: docs/design.md §9 defaults, the TOML file, HEARTH_* environment overrides, and loud errors."""

from __future__ import annotations

import re

import pydantic
import pytest

from hearth.services.common.config import ConfigError, HearthSettings, load_settings

FULL_TOML = """
[research]
enable = false

[research.distributed_inference]
enabled = true
max_shards_per_request = 3
shard_health_timeout_seconds = 12.5
fallback_to_local = false
fallback_to_local_after_failures = 1
activation_dtype = "int8"
allow_self_as_shard = false
max_concurrent_pipelines = 2

[research.distributed_inference.host]
serve_shards = true
shard_eviction_idle_seconds = 60
shard_max_memory_mb = 512

[transport]
window_chunks = 4
chunk_bytes = 65536
step_timeout_s = 2.5

[nats]
url = "nats://10.0.0.5:4222"
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("HEARTH_CONFIG", "HEARTH_NATS_URL"):
        monkeypatch.delenv(name, raising=False)
    import os

    for name in list(os.environ):
        if name.upper().startswith(("HEARTH_RESEARCH", "HEARTH_TRANSPORT", "HEARTH_NATS__", "HEARTH_SHARD__")):
            monkeypatch.delenv(name)


def test_defaults_are_those_of_the_specification():
    settings = load_settings()
    research = settings.research
    assert research.enable is True
    di = research.distributed_inference
    assert (di.enabled, di.max_shards_per_request, di.shard_health_timeout_s) == (True, 16, 30)
    assert (di.fallback_to_local, di.fallback_to_local_after_failures) == (True, 2)
    assert (di.activation_dtype, di.allow_self_as_shard, di.max_concurrent_pipelines) == ("auto", False, 4)
    shard = settings.shard
    assert (shard.serve_shards, shard.eviction_idle_s, shard.max_memory_mb, shard.kv_cache_budget_mb) == (
        False, 600, 20000, 1024,
    )
    assert (settings.transport.window_chunks, settings.transport.chunk_bytes) == (16, 1024 * 1024)
    assert settings.transport.step_timeout_s > 0
    assert settings.nats.url == "nats://127.0.0.1:4222"


def test_every_key_of_the_toml_file_is_read(tmp_path):
    path = tmp_path / "hearth.toml"
    path.write_text(FULL_TOML)
    settings = load_settings(path)
    di = settings.research.distributed_inference
    assert settings.research.enable is False
    assert (di.max_shards_per_request, di.shard_health_timeout_s, di.fallback_to_local) == (3, 12.5, False)
    assert (di.fallback_to_local_after_failures, di.activation_dtype, di.max_concurrent_pipelines) == (1, "int8", 2)
    shard = settings.shard  # the file names the specification's places, which still set them
    assert (shard.serve_shards, shard.eviction_idle_s, shard.max_memory_mb) == (True, 60, 512)
    assert (settings.transport.window_chunks, settings.transport.chunk_bytes) == (4, 65536)
    assert settings.transport.step_timeout_s == 2.5
    assert settings.nats.url == "nats://10.0.0.5:4222"


def test_environment_variables_override_the_file_and_keep_its_other_keys(tmp_path, monkeypatch):
    path = tmp_path / "hearth.toml"
    path.write_text(FULL_TOML)
    monkeypatch.setenv("HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__ALLOW_SELF_AS_SHARD", "true")
    monkeypatch.setenv("HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__HOST__SHARD_MAX_MEMORY_MB", "1024")
    monkeypatch.setenv("HEARTH_TRANSPORT__WINDOW_CHUNKS", "32")
    monkeypatch.setenv("hearth_research__enable", "true")  # names are case-insensitive

    settings = load_settings(path)

    di = settings.research.distributed_inference
    assert di.allow_self_as_shard is True
    assert settings.shard.max_memory_mb == 1024
    assert settings.shard.serve_shards is True and di.max_shards_per_request == 3  # still from the file
    assert settings.transport.window_chunks == 32 and settings.transport.chunk_bytes == 65536
    assert settings.research.enable is True


def test_the_file_comes_from_HEARTH_CONFIG_when_no_path_is_given(tmp_path, monkeypatch):
    path = tmp_path / "from-env.toml"
    path.write_text("[transport]\nwindow_chunks = 7\n")
    monkeypatch.setenv("HEARTH_CONFIG", str(path))
    assert load_settings().transport.window_chunks == 7
    # An explicit path wins over the variable.
    other = tmp_path / "explicit.toml"
    other.write_text("[transport]\nwindow_chunks = 9\n")
    assert load_settings(other).transport.window_chunks == 9


def test_keyword_overrides_win_over_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_TRANSPORT__WINDOW_CHUNKS", "32")
    settings = load_settings(transport={"window_chunks": 2})
    assert settings.transport.window_chunks == 2


def test_nats_url_defaults_to_HEARTH_NATS_URL(monkeypatch):
    monkeypatch.setenv("HEARTH_NATS_URL", "nats://example:4333")
    assert load_settings().nats.url == "nats://example:4333"


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_a_file_that_is_not_valid_toml_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[shard\nserve_shards = \n")
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))} is not valid TOML"):
        load_settings(path)


@pytest.mark.parametrize(
    "toml, expected",
    [("[shard\n", "is not valid TOML"), ("[shard]\nbogus_key = 1\n", "[shard] bogus_key in")],
)
def test_a_command_given_a_bad_configuration_file_says_so_in_one_line(tmp_path, toml, expected):
    from typer.testing import CliRunner

    from hearth.services.cli import app

    path = tmp_path / "hearth.toml"
    path.write_text(toml)
    result = CliRunner().invoke(app, ["--config", str(path), "orchestrator", "--insecure", "--nats",
                                      "nats://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert expected in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "toml, field",
    [
        ("[research]\nenabel = true\n", "enabel"),
        ("[research.distributed_inference]\nactivation_dtype = \"bf8\"\n", "activation_dtype"),
        ("[transport]\nwindow_chunks = 0\n", "window_chunks"),
        ("[unknown_section]\nx = 1\n", "unknown_section"),
    ],
)
def test_typos_and_invalid_values_are_rejected_with_the_field_named(tmp_path, toml, field):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_settings(path)


def test_an_invalid_environment_value_is_rejected(monkeypatch):
    monkeypatch.setenv("HEARTH_TRANSPORT__STEP_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=re.escape("$HEARTH_TRANSPORT__STEP_TIMEOUT_S: Input should be a valid")):
        load_settings()


def test_settings_are_immutable():
    settings = load_settings()
    assert isinstance(settings, HearthSettings)
    with pytest.raises(pydantic.ValidationError):
        settings.transport.window_chunks = 3


def test_the_shard_keys_live_in_the_shard_table_and_their_old_places_still_set_them(tmp_path, monkeypatch):
    new = tmp_path / "new.toml"
    new.write_text("[research.distributed_inference]\nshard_health_timeout_s = 12.5\n"
                   "[shard]\nserve_shards = false\neviction_idle_s = 60\nmax_memory_mb = 512\nkv_cache_budget_mb = 8\n"
                   "cuda_graph_max_tokens = 0\ncpu_linear_kernel = \"torch\"\n")
    settings = load_settings(new)
    assert settings.research.distributed_inference.shard_health_timeout_s == 12.5
    shard = settings.shard
    assert (shard.serve_shards, shard.eviction_idle_s, shard.max_memory_mb, shard.kv_cache_budget_mb) == (
        False, 60, 512, 8)
    assert (shard.cuda_graph_max_tokens, shard.cpu_linear_kernel, shard.kv_cache_budget_bytes) == (0, "torch", 8 << 20)

    old = tmp_path / "old.toml"
    old.write_text("[research.distributed_inference]\nshard_health_timeout_seconds = 12.5\n"
                   "[research.distributed_inference.host]\nserve_shards = false\nshard_eviction_idle_seconds = 60\n"
                   "shard_max_vram_mb = 512\nkv_cache_budget_mb = 8\ncuda_graph_max_tokens = 0\n"
                   "cpu_linear_kernel = \"torch\"\ndevice = \"cpu\"\n")
    from_old = load_settings(old)
    assert from_old.shard == settings.shard and from_old.shard.model_fields_set == settings.shard.model_fields_set
    assert from_old.research.distributed_inference.shard_health_timeout_s == 12.5
    assert from_old.research.distributed_inference.host.device == "cpu"  # the machine's keys stay where they were

    monkeypatch.setenv("HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__SHARD_HEALTH_TIMEOUT_SECONDS", "7")
    monkeypatch.setenv("HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__HOST__SHARD_EVICTION_IDLE_SECONDS", "9")
    monkeypatch.setenv("HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__HOST__SHARD_MAX_MEMORY_MB", "10")
    settings = load_settings()
    assert settings.research.distributed_inference.shard_health_timeout_s == 7
    assert (settings.shard.eviction_idle_s, settings.shard.max_memory_mb) == (9, 10)


def test_a_new_name_in_the_environment_wins_over_an_old_one_in_the_file(tmp_path, monkeypatch):
    old = tmp_path / "old.toml"
    old.write_text("[research.distributed_inference.host]\nkv_cache_budget_mb = 8\nshard_max_memory_mb = 512\n")
    monkeypatch.setenv("HEARTH_SHARD__KV_CACHE_BUDGET_MB", "16")
    shard = load_settings(old).shard
    assert (shard.kv_cache_budget_mb, shard.max_memory_mb) == (16, 512)


@pytest.mark.parametrize("toml, names", [
    ("[research.distributed_inference]\nshard_health_timeout_s = 1\nshard_health_timeout_seconds = 2\n",
     "shard_health_timeout_seconds is an old name of [research.distributed_inference] shard_health_timeout_s"),
    ("[shard]\nkv_cache_budget_mb = 1\n[research.distributed_inference.host]\nkv_cache_budget_mb = 2\n",
     "host] kv_cache_budget_mb is an old name of [shard] kv_cache_budget_mb"),
    ("[research.distributed_inference.host]\nshard_max_memory_mb = 1\nshard_max_vram_mb = 2\n",
     "shard_max_vram_mb is an old name of [shard] max_memory_mb"),
])
def test_a_key_given_under_two_of_its_names_is_refused_naming_both(tmp_path, toml, names):
    both = tmp_path / "both.toml"
    both.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(names)):
        load_settings(both)


def test_a_key_given_under_both_its_names_in_keyword_arguments_is_refused():
    with pytest.raises(ConfigError, match="give it once, as \\[shard\\] serve_shards"):
        load_settings(shard={"serve_shards": True},
                      research={"distributed_inference": {"host": {"serve_shards": False}}})
