"""A hub id naming a GGUF (a repository holding one, or "owner/name:FILE.gguf" for one of several): a host sizes its
range from the header read by byte ranges, a shard reads only its range's tensors and an orchestrator only the
head's, each loading exactly what the whole file gives and advertising the file's own digest; the whole model is
downloaded whole and checked against its listed SHA-256; bad names are refused in one line listing what the
repository holds. Served by a local server that speaks the hub's protocol, never the real hub."""

from __future__ import annotations

import asyncio
import shutil

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType

from hearth.inference import CheckpointError, load_head, load_layer_range, read_config_dict, resolve_model_path, \
    weights_sha256
from hearth.inference.gguf_parts import split_gguf
from hearth.inference.hub_fetch import hub_layout
from hearth.inference.hub_gguf import METADATA_FOLDER, SPANS_FOLDER, coalesced_spans
from hearth.inference.memory import layer_weight_bytes
from hearth.inference.quantization import parse_quantization
from hearth.services.common.config import HearthSettings
from hearth.services.devtools.demo_model import resolve_demo_model
from hearth.services.host.model_layout import model_layout
from hearth.services.orchestrator.catalog import ModelCatalog
from tests.runner_limits import RUNNER_KV_LIMITS

from .gguf_files import LLAMA3_ROPE_OVERRIDES, hub_repository_of_a_tiny_gguf, write_tiny_gguf
from .hub_server import FAKE_COMMIT, error_beside_a_stalled_twin, fake_hub  # noqa: F401  (fixture)
from .inference_tiny_models import TINY_NUM_LAYERS, one_torch_thread  # noqa: F401  (fixture)

REPO = "tiny-org/tiny-gguf"
FILE = "tiny-Q8_0.gguf"
OTHER_FILE = "tiny-Q4_0.gguf"


@pytest.fixture
def served(fake_hub, tmp_path, monkeypatch):  # noqa: F811
    """The fake hub serving a repository holding one tiny Q8_0 GGUF (and a README); (hub, the original file)."""
    monkeypatch.setenv("HEARTH_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = hub_repository_of_a_tiny_gguf(tmp_path, FILE)
    fake_hub.repos[REPO] = gguf_file.parent
    return fake_hub, gguf_file


@pytest.fixture
def two_ggufs(served, tmp_path):
    """The repository holding a Q4_0 GGUF of another model beside the Q8_0 one; (hub, the Q4_0 file)."""
    hub, original = served
    (tmp_path / "other").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "other", "llama", GGMLQuantizationType.Q4_0, seed=1)
    shutil.copyfile(path, original.with_name(OTHER_FILE))
    return hub, original.with_name(OTHER_FILE)


def _parameters(module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters())


def _assert_same_range(part, original, lo: int, hi: int) -> None:
    ranged = _parameters(load_layer_range(part, lo, hi, **RUNNER_KV_LIMITS))
    whole = _parameters(load_layer_range(original, lo, hi, **RUNNER_KV_LIMITS))
    assert ranged.keys() == whole.keys() and ranged
    assert all(torch.equal(ranged[name], whole[name]) for name in whole)


def _assert_same_head(ranged, whole) -> None:
    ids = ranged.encode_prompt("hello world")
    assert ids == whole.encode_prompt("hello world") and ranged.eos_token_ids == whole.eos_token_ids
    hidden = ranged.embed(ids)
    assert torch.equal(hidden, whole.embed(ids)) and torch.equal(ranged.logits(hidden), whole.logits(hidden))


def test_a_shard_reads_only_its_ranges_tensors_and_loads_them_as_from_the_file(served, tmp_path):
    hub, original = served
    path = resolve_model_path(REPO, needed_layers=(2, 3))

    assert path.name == FILE and hub.downloaded(REPO) == set()  # no whole-file GET, byte ranges only
    assert hub.bytes_sent < original.stat().st_size // 2
    assert {tensor.name.split(".")[1] for tensor in gguf.GGUFReader(path).tensors} == {"2", "3"}
    _assert_same_range(path, original, 2, 3)
    assert weights_sha256(path, cache_dir=tmp_path / "s1") == weights_sha256(original, cache_dir=tmp_path / "s2")

    hub.requests.clear()
    again = resolve_model_path(REPO, needed_layers=(2, 3), local_files_only=True)
    assert again == path and hub.requests == []


def test_a_head_read_by_ranges_is_the_files_head_with_its_tokenizer(served, tmp_path):
    hub, original = served
    path = resolve_model_path(REPO, needed_layers="head")

    assert hub.downloaded(REPO) == set() and hub.bytes_sent < original.stat().st_size
    ranged, whole = load_head(path), load_head(original)
    _assert_same_head(ranged, whole)
    assert weights_sha256(path, cache_dir=tmp_path / "s1") == weights_sha256(original, cache_dir=tmp_path / "s2")


def test_a_host_sizes_its_range_from_the_header_alone(served, tmp_path):
    hub, original = served
    scheme = parse_quantization("int8")
    layout = asyncio.run(model_layout(REPO, model_id=None, compute_dtype=torch.float32, quantize=scheme, nats_url=None,
                                      settings=HearthSettings()))

    expected = layer_weight_bytes(original, torch.float32, quantization=scheme)
    assert layout.total_layers == TINY_NUM_LAYERS and layout.served_id == REPO
    assert layout.layer_bytes == [expected[index] for index in range(TINY_NUM_LAYERS)]
    assert layout.weights_sha256 == weights_sha256(original, cache_dir=tmp_path / "sums")
    assert hub.downloaded(REPO) == set() and hub.bytes_sent < original.stat().st_size // 4

    sized_with = hub.bytes_sent
    resolve_model_path(REPO, needed_layers=(0, 1))
    wanted = [tensor for tensor in split_gguf(original).tensors if tensor.layer in (0, 1)]
    # Only the two layers' bytes: the header read for sizing is not read again.
    assert hub.bytes_sent - sized_with == sum(last - first + 1 for first, last in coalesced_spans(wanted))


def test_an_id_naming_one_of_several_ggufs_serves_that_file(two_ggufs, tmp_path):
    hub, other = two_ggufs
    model = f"{REPO}:{OTHER_FILE}"
    path = resolve_model_path(model, needed_layers=(4, 5))

    assert path.name == OTHER_FILE and hub.downloaded(REPO) == set()
    _assert_same_range(path, other, 4, 5)
    other_digest = weights_sha256(other, cache_dir=tmp_path / "sums")
    assert weights_sha256(path, cache_dir=tmp_path / "s1") == other_digest
    layout = asyncio.run(model_layout(model, model_id=None, compute_dtype=torch.float32,
                                      quantize=parse_quantization("none"), nats_url=None, settings=HearthSettings()))
    assert layout.served_id == model and layout.weights_sha256 == other_digest


def test_a_range_read_by_ranges_holds_the_tensors_every_layer_reads(served, tmp_path):
    _, original = served
    (tmp_path / "llama3").mkdir()
    path, _ = write_tiny_gguf(tmp_path / "llama3", "llama", GGMLQuantizationType.Q8_0, **LLAMA3_ROPE_OVERRIDES)
    shutil.copyfile(path, original.with_name("llama3.gguf"))

    part = resolve_model_path(f"{REPO}:llama3.gguf", needed_layers=(4, 5))

    assert "rope_freqs.weight" in {tensor.name for tensor in gguf.GGUFReader(part).tensors}
    assert read_config_dict(part)["rope_parameters"] == read_config_dict(path)["rope_parameters"]
    _assert_same_range(part, path, 4, 5)


def test_a_4_bit_gguf_sized_from_its_header_counts_its_layers_as_held(two_ggufs):
    """Under int8 a Q4_0 file's Linears are held in their stored 4-bit groups: the header alone says so."""
    _, other = two_ggufs
    int8, stored = parse_quantization("int8"), parse_quantization("int4/g32")
    layout = asyncio.run(model_layout(f"{REPO}:{OTHER_FILE}", model_id=None, compute_dtype=torch.float32,
                                      quantize=int8, nats_url=None, settings=HearthSettings()))

    as_held = layer_weight_bytes(other, torch.float32, quantization=int8)
    assert layout.layer_bytes == [as_held[index] for index in range(TINY_NUM_LAYERS)]
    assert as_held == layer_weight_bytes(other, torch.float32, quantization=stored)


def test_the_whole_model_of_a_named_gguf_is_downloaded_whole_and_checked(two_ggufs, tmp_path):
    hub, other = two_ggufs
    path = resolve_model_path(f"{REPO}:{OTHER_FILE}")

    assert hub.downloaded(REPO) == {OTHER_FILE} and path.read_bytes() == other.read_bytes()
    hub.requests.clear()
    assert resolve_model_path(f"{REPO}:{OTHER_FILE}", needed_layers=(0, 1)) == path  # the whole file serves ranges
    assert hub.requests == []
    demo_model = resolve_demo_model(f"{REPO}:{OTHER_FILE}")  # the demo and bench take it once it is here
    assert demo_model.path == path and demo_model.num_layers == TINY_NUM_LAYERS and hub.requests == []


def test_a_plain_id_of_several_ggufs_is_refused_naming_them_and_the_form(two_ggufs):
    hub, _ = two_ggufs
    with pytest.raises(CheckpointError) as refused:
        resolve_model_path(REPO, needed_layers=(0, 1))
    message = str(refused.value)
    assert "\n" not in message and f"several GGUF files ({OTHER_FILE}, {FILE})" in message
    assert f"{REPO}:{OTHER_FILE}" in message and hub.bytes_sent == 0


@pytest.mark.parametrize("needed", [(0, 1), None])
def test_a_file_the_repository_lacks_is_refused_listing_what_it_holds(two_ggufs, needed):
    hub, _ = two_ggufs
    with pytest.raises(CheckpointError) as refused:
        resolve_model_path(f"{REPO}:tiny-Q5_K.gguf", needed_layers=needed)
    message = str(refused.value)
    assert "\n" not in message and hub.bytes_sent == 0
    assert f"no file tiny-Q5_K.gguf: the repository holds the GGUF files {OTHER_FILE}, {FILE}" in message


def test_a_server_answering_without_ranges_gets_the_file_downloaded_whole_and_checked(served):
    hub, original = served
    hub.serves_ranges = False
    path = resolve_model_path(REPO, needed_layers=(2, 3))

    assert hub.downloaded(REPO) == {FILE} and path.read_bytes() == original.read_bytes()


def test_a_tampered_whole_download_is_refused_with_one_line(served):
    hub, original = served
    hub.tampered[FILE] = original.read_bytes()[:-64] + b"\0" * 64
    with pytest.raises(CheckpointError, match=f"{FILE} does not match its listed SHA-256"):
        resolve_model_path(f"{REPO}:{FILE}")


def _parts_folder(file: str):
    from hearth.inference.hub_fetch import HUB_GGUF_PARTS_FOLDER, hub_partial_root

    return hub_partial_root(REPO) / FAKE_COMMIT / HUB_GGUF_PARTS_FOLDER / file


def test_a_mirror_serving_a_file_of_another_size_is_refused(served):
    hub, original = served
    hub.tampered[FILE] = original.read_bytes() + b"\0" * 64
    with pytest.raises(CheckpointError, match=f"{FILE}: asked for bytes 0-.* the server sent bytes 0-"):
        resolve_model_path(REPO, needed_layers=(0, 1))


def test_a_header_past_the_bound_is_refused_in_one_line(served, monkeypatch):
    hub, _ = served
    monkeypatch.setattr("hearth.inference.hub_gguf.HEADER_FIRST_READ_BYTES", 512)
    monkeypatch.setattr("hearth.inference.hub_gguf.MAX_GGUF_HEADER_BYTES", 2048)
    with pytest.raises(CheckpointError, match=f"{FILE}'s header is longer than 2048 bytes") as refused:
        resolve_model_path(REPO, needed_layers=(0, 1))
    assert "\n" not in str(refused.value) and hub.bytes_sent <= 2048


def _layer_one_span(original):
    """Once the header is kept (what follows reads only spans): the spans folder and layer 1's one span (first and
    last byte)."""
    resolve_model_path(REPO, needed_layers=(0, 0))
    [(first, last)] = coalesced_spans([tensor for tensor in split_gguf(original).tensors if tensor.layer == 1])
    spans = _parts_folder(FILE) / SPANS_FOLDER
    spans.mkdir(parents=True, exist_ok=True)
    return spans, first, last


def test_an_interrupted_span_is_resumed_where_it_ended(served):
    hub, original = served
    spans, first, last = _layer_one_span(original)
    already = (last - first + 1) // 2
    (spans / f"{first}-{last}.part").write_bytes(original.read_bytes()[first:first + already])
    before = hub.bytes_sent

    path = resolve_model_path(REPO, needed_layers=(1, 1))
    assert hub.bytes_sent - before == last - first + 1 - already
    _assert_same_range(path, original, 1, 1)


async def test_an_orchestrator_given_a_gguf_hub_id_fetches_only_the_head(two_ggufs, tmp_path):
    hub, other = two_ggufs
    model = f"{REPO}:{OTHER_FILE}"
    catalog = ModelCatalog([])
    try:
        loaded = await catalog.get(model)
    finally:
        catalog.close()

    assert loaded.model_id == model and hub.downloaded(REPO) == set()
    assert hub.bytes_sent < other.stat().st_size
    assert loaded.weights_sha256 == weights_sha256(other, cache_dir=tmp_path / "sums")
    _assert_same_head(loaded.head, load_head(other))


def test_a_server_sending_on_past_the_asked_range_is_not_read_without_end(tmp_path, monkeypatch):
    import contextlib
    import io
    from types import SimpleNamespace

    from hearth.inference import hub_gguf

    first, last, sent = 100, 199, []

    def endless():
        while True:
            sent.append(1)
            if len(sent) > 1000:
                raise AssertionError("the body was read on past the range")
            yield b"x" * 64

    class Session:
        @contextlib.contextmanager
        def stream(self, *args, **kwargs):
            yield SimpleNamespace(status_code=206, headers={"Content-Range": f"bytes {first}-{last}/1000"},
                                  iter_bytes=endless, raise_for_status=lambda: None)

    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: Session())
    hub = hub_gguf.HubGGUF(repo_id="o/r", file="x.gguf", commit=FAKE_COMMIT, size=1000, sha256="0" * 64,
                           folder=tmp_path)
    out = io.BytesIO()
    hub_gguf._fetch_range(hub, first, last, out, None)
    assert out.getvalue() == b"x" * (last - first + 1) and len(sent) == 2


def test_a_span_waits_for_a_twin_only_while_the_twin_makes_progress(served, monkeypatch):
    hub, original = served
    resolve_model_path(REPO, needed_layers=(0, 0))  # the header is kept; what follows reads only spans
    [(first, last)] = coalesced_spans([tensor for tensor in split_gguf(original).tensors if tensor.layer == 1])
    spans = _parts_folder(FILE) / SPANS_FOLDER
    spans.mkdir(parents=True, exist_ok=True)
    error = error_beside_a_stalled_twin(spans / f"{first}-{last}.part",
                                        lambda: resolve_model_path(REPO, needed_layers=(1, 1)), monkeypatch)
    assert isinstance(error, CheckpointError) and "without progress for 1 s" in str(error)
    assert "\n" not in str(error)


def test_a_gguf_part_of_a_range_left_behind_is_removed_once_no_process_holds_it(served):
    from hearth.inference.cache_ranges import SELECTION_NAME, release_held_ranges, release_range

    try:
        left = resolve_model_path(REPO, needed_layers=(0, 1))
        head = resolve_model_path(REPO, needed_layers="head")
        release_range(left)  # a host that moved on to another range
        resolve_model_path(REPO, needed_layers=(2, 3))
        parts = {entry.name for entry in _parts_folder(FILE).iterdir() if SELECTION_NAME.match(entry.name)}
        assert parts == {"layers-2-3", "head"} and head.is_file()
    finally:
        release_held_ranges()


def test_a_finished_span_left_short_by_a_crash_is_fetched_again(served):
    # A span renamed into place whole and cut short since (a crash before its bytes reached the disk leaves it
    # empty): taken as done, every later start refused the part as not forming a GGUF.
    hub, original = served
    spans, first, last = _layer_one_span(original)
    (spans / f"{first}-{last}.bin").write_bytes(b"")

    path = resolve_model_path(REPO, needed_layers=(1, 1))
    _assert_same_range(path, original, 1, 1)


def test_a_metadata_file_left_empty_by_a_crash_is_written_again(served, tmp_path):
    # Written whole and renamed into place, but a crash before its bytes reached the disk leaves it empty: taken as
    # written, every later sizing refused the model as an empty GGUF.
    hub, original = served
    layout = hub_layout(REPO)
    metadata = _parts_folder(FILE) / METADATA_FOLDER / FILE
    metadata.write_bytes(b"")

    assert hub_layout(REPO) == layout
