"""What is parsed from a GGUF (config, tensor table, tokenizer, the demo's description) is kept on disk per file
version: a cached load gives exactly what a parse gives, a changed file is parsed again, and a cache that cannot be
written or holds damaged entries only costs a re-parse."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.formats.cache_layout import ENTRY_SOURCE_FILE, entry_description
from hearth.inference import gguf_cache, gguf_checkpoint, gguf_tensor_table, load_head, load_layer_range
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.gguf_cache import GGUFCacheEntry, gguf_cache_entry
from hearth.inference.gguf_checkpoint import gguf_config_dict, load_gguf_tokenizer
from hearth.inference.gguf_tensor_table import gguf_table
from hearth.services.devtools.demo_model import resolve_demo_model

from .gguf_files import write_tiny_gguf
from .inference_tiny_models import one_torch_thread  # noqa: F401  (fixture)

MESSAGES = [{"role": "user", "content": "hello there, the quick brown fox"}]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    new_process()
    yield
    new_process()


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory):
    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf-cache"), "llama", GGMLQuantizationType.Q8_0)
    return path


def new_process():
    """Forget what this process parsed, as a process started afresh would."""
    gguf_checkpoint._cached_config.cache_clear()
    gguf_tensor_table._cached_table.cache_clear()


@pytest.fixture
def parses(monkeypatch):
    """How often each GGUF parse ran."""
    counts = {"config": 0, "table": 0, "tokenizer": 0}

    def counted(kind, function):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(gguf_checkpoint, "parsed_gguf_config", counted("config", gguf_checkpoint.parsed_gguf_config))
    monkeypatch.setattr(gguf_tensor_table, "_parsed_table", counted("table", gguf_tensor_table._parsed_table))
    monkeypatch.setattr(gguf_checkpoint, "_parsed_tokenizer",
                        counted("tokenizer", gguf_checkpoint._parsed_tokenizer))
    return counts


def test_a_cached_load_gives_exactly_what_a_parse_gives(tiny_gguf_file, parses):
    parsed_range, parsed_head = load_layer_range(tiny_gguf_file, 1, 3, **RUNNER_KV_LIMITS), load_head(tiny_gguf_file)
    parsed = gguf_config_dict(tiny_gguf_file), gguf_table(tiny_gguf_file)
    assert parses == {"config": 1, "table": 1, "tokenizer": 1}
    new_process()

    cached_range, cached_head = load_layer_range(tiny_gguf_file, 1, 3, **RUNNER_KV_LIMITS), load_head(tiny_gguf_file)

    assert parses == {"config": 1, "table": 1, "tokenizer": 1}  # nothing parsed again
    assert (gguf_config_dict(tiny_gguf_file), gguf_table(tiny_gguf_file)) == parsed
    assert cached_head.tokenizer.name_or_path != parsed_head.tokenizer.name_or_path  # the saved copy
    for (name, tensor), (_, want) in zip(cached_range.named_parameters(), parsed_range.named_parameters(),
                                         strict=True):
        assert torch.equal(tensor, want), name
    assert cached_head.encode_chat(MESSAGES) == parsed_head.encode_chat(MESSAGES)
    assert cached_head.encode_prompt("a b c") == parsed_head.encode_prompt("a b c")
    assert cached_head.tokenizer.chat_template == parsed_head.tokenizer.chat_template
    assert cached_head.eos_token_ids == parsed_head.eos_token_ids
    ids = torch.tensor([cached_head.encode_chat(MESSAGES)])
    assert torch.equal(cached_head.embed(ids), parsed_head.embed(ids))


def test_a_changed_file_is_parsed_again(tmp_path, parses):
    path, _ = write_tiny_gguf(tmp_path / "v1", "llama", GGMLQuantizationType.F16)
    first = gguf_table(path)
    new_process()
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 10**9))  # touched
    assert gguf_table(path) == first and parses["table"] == 2

    new_process()
    rewritten, _ = write_tiny_gguf(tmp_path / "v1", "llama", GGMLQuantizationType.Q8_0)  # same name, new contents
    assert rewritten == path
    assert {t.block_type.name for t in gguf_table(path).tensors} == {"F32", "Q8_0"}
    assert parses["table"] == 3


def test_a_file_rewritten_with_its_size_and_mtime_restored_is_parsed_again(tmp_path, parses):
    path, _ = write_tiny_gguf(tmp_path / "v1", "llama", GGMLQuantizationType.F16)
    first = gguf_table(path)
    stat = path.stat()
    old_entry = gguf_cache_entry(path).folder
    new_process()
    rewritten, _ = write_tiny_gguf(tmp_path / "v2", "llama", GGMLQuantizationType.F16)
    content = bytearray(rewritten.read_bytes())
    content[-1] ^= 0xFF  # other weights, the same size and tensor table
    assert len(content) == stat.st_size
    path.write_bytes(bytes(content))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p`, `touch -r` or `rsync -t` leave it

    assert gguf_table(path) == first and parses["table"] == 2  # parsed again, not served from the old entry
    assert gguf_cache_entry(path).folder != old_entry


def test_an_unwritable_cache_only_costs_a_parse(tiny_gguf_file, tmp_path, monkeypatch, parses):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(blocker / "cache"))

    head = load_head(tiny_gguf_file)
    new_process()
    again = load_head(tiny_gguf_file)

    assert again.encode_chat(MESSAGES) == head.encode_chat(MESSAGES)
    assert parses["config"] == parses["table"] == 2


def test_damaged_entries_are_parsed_again_and_replaced(tiny_gguf_file, parses):
    config, table = gguf_config_dict(tiny_gguf_file), gguf_table(tiny_gguf_file)
    tokenizer = load_gguf_tokenizer(tiny_gguf_file)
    entry = gguf_cache_entry(tiny_gguf_file)
    (entry.folder / "config.json").write_text("[1, 2")
    (entry.folder / "table.json").write_text('{"tensors": [["x"]]}')
    (entry.folder / "tokenizer" / "tokenizer.json").write_text("{")
    new_process()

    assert (gguf_config_dict(tiny_gguf_file), gguf_table(tiny_gguf_file)) == (config, table)
    assert load_gguf_tokenizer(tiny_gguf_file).encode("a b c") == tokenizer.encode("a b c")
    assert parses == {"config": 2, "table": 2, "tokenizer": 2}
    new_process()
    assert (gguf_config_dict(tiny_gguf_file), gguf_table(tiny_gguf_file)) == (config, table)
    assert load_gguf_tokenizer(tiny_gguf_file).encode("a b c") == tokenizer.encode("a b c")
    assert parses == {"config": 2, "table": 2, "tokenizer": 2}
    kept = sorted(p.name for p in entry.folder.iterdir() if not p.name.endswith(".lock"))
    # Nothing staged or set aside is left behind; what the entry holds is said for `hearth cache list`.
    assert kept == ["config.json", ENTRY_SOURCE_FILE, "table.json", "tokenizer"]
    assert entry_description(entry.folder) == f"the metadata of {tiny_gguf_file.resolve()}"


def test_loads_starting_together_parse_the_file_once(tiny_gguf_file, parses):
    with ThreadPoolExecutor(max_workers=3) as pool:  # each thread opens the lock on its own, as a process would
        configs = list(pool.map(gguf_config_dict, [tiny_gguf_file] * 3))
        tables = list(pool.map(gguf_table, [tiny_gguf_file] * 3))

    assert configs[0] == configs[1] == configs[2] and tables[0] == tables[1] == tables[2]
    assert parses["config"] == parses["table"] == 1


def test_a_folder_saved_by_another_process_first_is_kept_and_nothing_is_left_behind(tmp_path):
    entry = GGUFCacheEntry(tmp_path / "entry")

    def loses_the_race(staging):
        (staging / "mine.txt").write_text("late")
        (entry.folder / "tokenizer").mkdir()
        (entry.folder / "tokenizer" / "theirs.txt").write_text("first")

    entry.save_folder("tokenizer", loses_the_race)

    assert [p.name for p in entry.folder.iterdir()] == ["tokenizer"]
    assert [p.name for p in (entry.folder / "tokenizer").iterdir()] == ["theirs.txt"]


def test_the_oldest_entries_beyond_the_limit_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "GGUF_CACHE_MAX_ENTRIES", 2)
    files = [tmp_path / f"model{index}.gguf" for index in range(3)]
    for index, file in enumerate(files):
        file.write_bytes(b"x")
        entry = gguf_cache_entry(file)
        entry.write_json("value", index)
        os.utime(entry.folder, ns=((index + 1) * 10**9, (index + 1) * 10**9))

    assert [gguf_cache_entry(f).read_json("value") for f in files] == [None, 1, 2]


def test_the_demo_keeps_its_description_in_the_same_entry(tiny_gguf_file):
    model = resolve_demo_model(str(tiny_gguf_file))

    entry = gguf_cache_entry(tiny_gguf_file)
    assert entry.read_json("demo-description") == {"architecture": "llama", "num_layers": model.num_layers,
                                                   "has_chat_template": True}
