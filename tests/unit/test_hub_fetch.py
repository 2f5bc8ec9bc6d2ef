"""Given a hub id, a shard host downloads only the safetensors files holding its layers (and the head only the files
holding embedding, norm and lm_head), checked against the listed SHA-256, from a local server that speaks the hub's
protocol (never the real hub)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import pytest
import torch

from hearth.inference import CheckpointError, load_head, load_layer_range, resolve_model_path, weights_sha256
from tests.runner_limits import RUNNER_KV_LIMITS
from hearth.inference.hub_cache import complete_hub_snapshot
from hearth.inference.hub_fetch import hub_layout
from hearth.inference.memory import layer_weight_bytes
from hearth.inference.partial_checkpoint import files_holding
from hearth.inference.quantization import parse_quantization

from .hub_server import FAKE_COMMIT, error_beside_a_stalled_twin, fake_hub  # noqa: F401  (fixture)
from .inference_tiny_models import one_torch_thread, tiny_model_dir  # noqa: F401  (fixtures)

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def served(fake_hub, tiny_model_dir):  # noqa: F811
    """The fake hub serving a tiny llama saved in many small safetensors files, and that folder's weight_map."""
    folder = tiny_model_dir("llama", max_shard_size="100KB")
    fake_hub.repos[REPO] = folder
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 6
    return fake_hub, folder, weight_map


def _same_parameters(first, second) -> bool:
    left, right = dict(first.named_parameters()), dict(second.named_parameters())
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def test_a_shard_downloads_only_the_files_holding_its_layers(served, tmp_path):
    hub, original, weight_map = served
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(2, 3))

    wanted = files_holding(weight_map, (2, 3))
    downloaded = hub.downloaded(REPO)
    assert {name for name in downloaded if name.endswith(".safetensors")} == wanted
    assert wanted < set(weight_map.values())
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= downloaded
    assert _same_parameters(load_layer_range(folder, 2, 3, **RUNNER_KV_LIMITS),
                            load_layer_range(original, 2, 3, **RUNNER_KV_LIMITS))
    assert weights_sha256(folder, cache_dir=tmp_path / "sums") == weights_sha256(original, cache_dir=tmp_path / "sums")


def test_the_head_downloads_only_embedding_norm_and_lm_head_files(served, tmp_path):
    hub, original, weight_map = served
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers="head")

    wanted = files_holding(weight_map, "head")
    assert {name for name in hub.downloaded(REPO) if name.endswith(".safetensors")} == wanted
    head, reference = load_head(folder), load_head(original)
    tokens = torch.tensor([[1, 5, 7]])
    assert torch.equal(head.embed(tokens), reference.embed(tokens))


def test_two_ranges_of_one_repository_advertise_one_digest_and_a_second_start_needs_no_network(served, tmp_path):
    hub, original, _ = served
    low = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(0, 1))
    high = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(4, 5))
    assert weights_sha256(low, cache_dir=tmp_path / "sums") == weights_sha256(high, cache_dir=tmp_path / "sums")

    hub.requests.clear()
    again = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(0, 1), local_files_only=True)
    assert again == low and hub.requests == []


def test_a_tampered_file_is_refused_with_one_line(served, tmp_path):
    hub, original, weight_map = served
    victim = sorted(files_holding(weight_map, (1, 1)))[0]
    hub.tampered[victim] = b"\0" * (original / victim).stat().st_size
    with pytest.raises(CheckpointError, match=f"{victim} does not match its listed SHA-256"):
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    # The refused file is not kept as downloaded: once the mirror serves it right, the next try fetches it again.
    hub.tampered.clear()
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert (folder / victim).is_file()


@pytest.mark.parametrize("kind", ["side file", "weight file"])
def test_a_file_served_larger_than_listed_is_refused_before_its_body_is_read(served, tmp_path, kind):
    hub, original, weight_map = served
    victim = "tokenizer.json" if kind == "side file" else sorted(files_holding(weight_map, (1, 1)))[0]
    listed, extra = (original / victim).stat().st_size, 32 << 20
    hub.tampered[victim] = (original / victim).read_bytes() + b" " * extra
    with pytest.raises(CheckpointError, match=f"^model '{REPO}': {victim} is {listed + extra} bytes, not the {listed} "
                                              "its listing states"):
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert hub.bytes_delivered < 16 << 20  # its Content-Length refused it: the body was not read
    assert not [file for file in (tmp_path / "cache").rglob(f"*{victim}*") if file.stat().st_size]  # its lock, empty
    hub.tampered.clear()
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert (folder / victim).read_bytes() == (original / victim).read_bytes()


@pytest.mark.parametrize("kind", ["side file", "weight file"])
def test_a_file_sent_past_its_listed_size_is_cut_off_there_and_not_kept(served, tmp_path, kind):
    hub, original, weight_map = served
    victim = "tokenizer.json" if kind == "side file" else sorted(files_holding(weight_map, (1, 1)))[0]
    listed = (original / victim).stat().st_size
    hub.oversent[victim] = 64 << 20  # no Content-Length: only the listed size can bound it
    with pytest.raises(CheckpointError, match=f"^model '{REPO}': {victim} arrived with more than the {listed} bytes "
                                              "its listing states"):
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert hub.bytes_delivered < 16 << 20  # stopped where it passed its size, not read to its end
    assert not [file for file in (tmp_path / "cache").rglob(f"*{victim}*") if file.stat().st_size]  # its lock, empty
    hub.oversent.clear()
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert (folder / victim).read_bytes() == (original / victim).read_bytes()


def test_a_damaged_cached_file_is_downloaded_again_before_its_folder_is_reused(served, tmp_path):
    hub, original, weight_map = served
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    victim = sorted(files_holding(weight_map, (1, 1)))[0]
    with (folder / victim).resolve().open("r+b") as handle:  # truncated, as a full disk or a crash leaves a file
        handle.truncate(100)
    with pytest.raises(CheckpointError, match="downloads are disabled"):  # offline: refused, not loaded damaged
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1), local_files_only=True)

    hub.requests.clear()
    again = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert again == folder and (again / victim).read_bytes() == (original / victim).read_bytes()
    assert {name for name in hub.downloaded(REPO) if name.endswith(".safetensors")} == {victim}


def test_a_new_commit_downloaded_removes_earlier_ones_no_revision_names_and_no_process_uses(served, tmp_path,
                                                                                           monkeypatch):
    from hearth.inference.cache_versions import release_held_versions

    root = tmp_path / "cache" / "hearth-partial" / REPO.replace("/", "--")
    resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(2, 2))
    release_held_versions()  # the processes that loaded them ended
    newer = "c0ffee0000000000000000000000000000000002"
    monkeypatch.setattr("tests.unit.hub_server.FAKE_COMMIT", newer)  # the repository moved on
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(3, 3))  # a part not cached
    assert folder.parent == root / newer
    assert {entry.name for entry in root.iterdir() if not entry.name.startswith(".")} == {"refs", newer}
    release_held_versions()


def test_a_listing_without_end_is_refused_past_its_bound(served, tmp_path):
    hub, _, _ = served
    hub.endless_listing = True
    with pytest.raises(CheckpointError, match=f"^model '{REPO}' lists more than 10000 files: not a model hearth "
                                              "downloads$"):
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert hub.listing_pages <= 11


@pytest.mark.parametrize("points_to", ["an absolute path", "a path up and out"])
def test_an_index_naming_a_file_outside_its_folder_is_refused(fake_hub, tiny_model_dir, tmp_path, points_to):  # noqa: F811
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir("llama", max_shard_size="100KB"), repo)
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    outside = tmp_path / "outside.safetensors"
    shutil.copy(repo / index["weight_map"]["model.embed_tokens.weight"], outside)
    named = str(outside) if points_to == "an absolute path" else "../../../../../../outside.safetensors"
    index["weight_map"]["model.embed_tokens.weight"] = named
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    fake_hub.repos[REPO] = repo
    refusal = (f"model.safetensors.index.json maps 'model.embed_tokens.weight' to '{re.escape(named)}', not a file "
               "of its folder$")
    with pytest.raises(CheckpointError, match=refusal):  # a local folder
        load_head(repo)
    snapshots = tmp_path / "hub-cache" / f"models--{REPO.replace('/', '--')}"  # a snapshot the hub client cached
    shutil.copytree(repo, snapshots / "snapshots" / FAKE_COMMIT)
    (snapshots / "refs").mkdir()
    (snapshots / "refs" / "main").write_text(FAKE_COMMIT)
    with pytest.raises(CheckpointError, match=refusal):
        complete_hub_snapshot(REPO, None, tmp_path / "hub-cache")
    with pytest.raises(CheckpointError, match=refusal):  # a range's download
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers="head")


def test_a_commit_that_is_no_commit_hash_is_refused_before_any_folder_is_named_by_it(served, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    for answered in (str(outside), "../../outside", "main"):
        monkeypatch.setattr("tests.unit.hub_server.FAKE_COMMIT", answered)
        with pytest.raises(CheckpointError, match="not a commit hash"):
            resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert not outside.exists() and not (tmp_path / "outside").exists()


def test_offline_without_a_cached_part_is_a_checkpoint_error(served, tmp_path):
    with pytest.raises(CheckpointError, match="downloads are disabled"):
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(0, 1), local_files_only=True)


def test_a_host_sizes_its_range_from_headers_alone_then_fetches_only_that_range(served, tmp_path, monkeypatch):
    from hearth.services.common.config import HearthSettings
    from hearth.services.host.model_layout import model_layout

    hub, original, weight_map = served
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    scheme = parse_quantization("int8")
    layout = asyncio.run(model_layout(REPO, model_id=None, compute_dtype=torch.float32, quantize=scheme, nats_url=None,
                                      settings=HearthSettings()))

    expected = layer_weight_bytes(original, torch.float32, quantization=scheme)
    assert layout.layer_bytes == [expected[index] for index in range(6)] and layout.served_id == REPO
    assert layout.weights_sha256 == weights_sha256(original, cache_dir=tmp_path / "sums")
    assert {name for name in hub.downloaded(REPO) if name.endswith(".safetensors")} == set()
    assert {path.rsplit("/", 1)[1] for method, path in hub.requests if method == "RANGE"} == set(weight_map.values())

    folder = resolve_model_path(REPO, needed_layers=(4, 5))
    assert weights_sha256(folder, cache_dir=tmp_path / "sums") == layout.weights_sha256
    assert {name for name in hub.downloaded(REPO) if name.endswith(".safetensors")} == files_holding(weight_map, (4, 5))


def test_sizing_from_the_hub_offline_is_a_checkpoint_error(served):
    with pytest.raises(CheckpointError, match="downloads are disabled"):
        hub_layout(REPO, local_files_only=True)


@pytest.mark.parametrize("bound, value, refusal", [
    ("MAX_SIDE_FILE_BYTES", 16, "over 16 bytes"),
    ("MAX_SIDE_FILES", 1, r"\(more than 1\)"),
])
def test_a_repository_listing_too_many_or_too_large_side_files_downloads_nothing(served, tmp_path, monkeypatch,
                                                                                  bound, value, refusal):
    hub, _, _ = served
    monkeypatch.setattr(f"hearth.inference.hub_fetch.{bound}", value)
    with pytest.raises(CheckpointError, match=f"files besides its weights.*{refusal}.*not a model hearth downloads"):
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert not hub.downloaded(REPO)


def test_a_listed_partial_checkpoint_marker_is_not_taken_as_the_folders(served, tmp_path):
    import shutil

    hub, original, _ = served
    copy = tmp_path / "served"
    shutil.copytree(original, copy)
    (copy / "hearth-partial-checkpoint.json").write_text(json.dumps({"weights_sha256": "0" * 64}))
    hub.repos[REPO] = copy
    folder = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1))
    assert "hearth-partial-checkpoint.json" not in hub.downloaded(REPO)
    assert weights_sha256(folder, cache_dir=tmp_path / "s1") == weights_sha256(original, cache_dir=tmp_path / "s2")


def test_a_download_waits_for_a_twin_only_while_the_twin_makes_progress(served, tmp_path, monkeypatch):
    from hearth.inference import hub_download

    hub, _, weight_map = served
    files = tmp_path / "cache" / "hearth-partial" / REPO.replace("/", "--") / FAKE_COMMIT / "files"
    files.mkdir(parents=True)
    victim = sorted(files_holding(weight_map, (1, 1)))[0]
    error = error_beside_a_stalled_twin(files / f".{victim}{hub_download.LOCK_SUFFIX}", lambda: resolve_model_path(
        REPO, cache_dir=tmp_path / "cache", needed_layers=(1, 1)), monkeypatch)
    assert isinstance(error, CheckpointError) and "without progress for 1 s" in str(error)


def test_a_range_left_behind_is_removed_with_the_files_only_it_needed_unless_a_process_holds_it(served, tmp_path):
    import fcntl

    from hearth.inference.cache_ranges import RANGES_FOLDER, release_held_ranges, release_range

    _, _, weight_map = served
    commit_dir = tmp_path / "cache" / "hearth-partial" / REPO.replace("/", "--") / FAKE_COMMIT
    weight_files = lambda: {file.name for file in (commit_dir / "files").glob("*.safetensors")}  # noqa: E731
    try:
        left = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(0, 1))
        release_range(left)  # a host that moved on to another range
        resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(4, 5))
        assert not (commit_dir / "layers-0-1").exists()
        assert weight_files() == files_holding(weight_map, (4, 5)) != files_holding(weight_map, (0, 1))

        release_held_ranges()  # the process serving 4-5 ended ...
        with open(commit_dir / RANGES_FOLDER / "layers-4-5.in-use", "a") as other_process:
            fcntl.flock(other_process, fcntl.LOCK_SH)  # ... but another one on the machine serves it
            resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(2, 3))
            assert (commit_dir / "layers-4-5").is_dir()
            assert weight_files() == files_holding(weight_map, (4, 5)) | files_holding(weight_map, (2, 3))
        again = resolve_model_path(REPO, cache_dir=tmp_path / "cache", needed_layers=(4, 5), local_files_only=True)
        assert again == commit_dir / "layers-4-5"
    finally:
        release_held_ranges()
