"""What fetching a hub GGUF by byte ranges leaves behind is removed: a part's span files once the part is written,
an interrupted part's once stale, never those of a part a process still fetches; and once the file is downloaded
whole, its parts no process holds. Served by a local server that speaks the hub's protocol, never the real hub."""

from __future__ import annotations

import os

from hearth.inference import resolve_model_path
from hearth.inference.cache_ranges import SELECTION_NAME, hold_range, release_held_ranges, release_range
from hearth.inference import gguf_parts, hub_gguf
from hearth.inference.gguf_header import parse_gguf_header
from hearth.inference.gguf_parts import split_gguf
from hearth.inference.hub_gguf import HEADER_FILE, SPANS_FOLDER, STALE_SPAN_S, coalesced_spans, remove_part_leftovers
from tests.unit.hub_server import fake_hub  # noqa: F401  (fixture)
from tests.unit.test_hub_gguf import FILE, REPO, _parts_folder, served  # noqa: F401  (fixture: one GGUF served)


def _span_of_layer(original, layer: int) -> tuple[int, int]:
    [span] = coalesced_spans([tensor for tensor in split_gguf(original).tensors if tensor.layer == layer])
    return span


def _leave_span(original, layer: int, suffix: str, *, stale: bool) -> str:
    """A span file of `layer`'s part as a fetch left it (".part": interrupted halfway; ".bin": whole), touched now
    or longer ago than STALE_SPAN_S; its name."""
    first, last = _span_of_layer(original, layer)
    spans = _parts_folder(FILE) / SPANS_FOLDER
    spans.mkdir(parents=True, exist_ok=True)
    span = spans / f"{first}-{last}{suffix}"
    end = last + 1 if suffix == ".bin" else first + (last - first + 1) // 2
    span.write_bytes(original.read_bytes()[first:end])
    if stale:
        long_ago = span.stat().st_mtime - STALE_SPAN_S - 60
        os.utime(span, (long_ago, long_ago))
    return span.name


def _span_files() -> set[str]:
    spans = _parts_folder(FILE) / SPANS_FOLDER
    return {entry.name for entry in spans.iterdir()} if spans.is_dir() else set()


def _parts() -> set[str]:
    return {entry.name for entry in _parts_folder(FILE).iterdir() if SELECTION_NAME.match(entry.name)}


def test_a_written_parts_spans_go_at_once_and_an_interrupted_parts_once_stale(served):
    hub, original = served
    try:
        resolve_model_path(REPO, needed_layers=(0, 0))  # the header is kept; what follows reads only spans
        assert _span_files() == set()
        fresh = _leave_span(original, 1, ".part", stale=False)  # a restart soon resumes it
        _leave_span(original, 3, ".part", stale=True)
        _leave_span(original, 4, ".bin", stale=True)
        _leave_span(original, 2, ".bin", stale=False)  # fetched, its part not yet written when that process ended
        before = hub.bytes_sent

        resolve_model_path(REPO, needed_layers=(2, 2))
        assert hub.bytes_sent == before  # layer 2's span was taken as it was
        assert _span_files() == {fresh}

        first, last = _span_of_layer(original, 1)
        resolve_model_path(REPO, needed_layers=(1, 1))
        assert hub.bytes_sent - before == last - first + 1 - (last - first + 1) // 2  # resumed
        assert _span_files() == set()
    finally:
        release_held_ranges()


def test_the_spans_of_a_part_a_process_still_fetches_are_kept_however_old(served):
    _, original = served
    try:
        resolve_model_path(REPO, needed_layers=(0, 0))
        fetching = _parts_folder(FILE) / "layers-1-1"
        hold_range(_parts_folder(FILE), fetching)  # as a process fetching it holds it
        kept = _leave_span(original, 1, ".part", stale=True)

        resolve_model_path(REPO, needed_layers=(2, 2))
        assert _span_files() == {kept}

        release_range(fetching)  # that process ended without writing its part
        resolve_model_path(REPO, needed_layers=(3, 3))
        assert _span_files() == set()
    finally:
        release_held_ranges()


def test_once_the_file_is_downloaded_whole_its_parts_no_process_holds_are_removed(served):
    hub, original = served
    try:
        left = resolve_model_path(REPO, needed_layers=(0, 0))
        serving = resolve_model_path(REPO, needed_layers=(2, 2))
        release_range(left)  # a host that moved on; the one serving layer 2 still runs
        _leave_span(original, 3, ".part", stale=False)

        whole = resolve_model_path(f"{REPO}:{FILE}")  # the whole model: downloaded whole
        assert hub.downloaded(REPO) == {FILE} and whole.read_bytes() == original.read_bytes()
        assert _parts() == {"layers-2-2"} and serving.is_file() and _span_files() == set()

        release_range(serving)
        hub.requests.clear()
        assert resolve_model_path(REPO, needed_layers=(2, 2), local_files_only=True) == whole
        assert _parts() == set() and hub.requests == []
    finally:
        release_held_ranges()



def test_a_twin_that_writes_the_same_part_first_leaves_this_process_its_folder(served, monkeypatch):
    """Two hosts on one machine fetch the same part at once: the one that writes it first removes its span files,
    which the other may still be reading to write its own copy; that one then serves the folder written."""
    _, original = served
    writes: list[tuple] = []
    write_folder, check_placements = gguf_parts.write_gguf_folder, gguf_parts._check_placements

    def recorded_write(*args, **kwargs):
        writes.append((args, kwargs))
        return write_folder(*args, **kwargs)

    def twin_writes_it_meanwhile(*args):
        check_placements(*args)
        if len(writes) == 1:  # this process has begun writing the part: the twin finishes first, and cleans
            writes.append(("twin",))
            write_folder(*writes[0][0], **writes[0][1])
            parsed = parse_gguf_header((_parts_folder(FILE) / HEADER_FILE).read_bytes(), original.stat().st_size,
                                       FILE)
            remove_part_leftovers(_parts_folder(FILE), parsed, (1, 1))

    monkeypatch.setattr(hub_gguf, "write_gguf_folder", recorded_write)
    monkeypatch.setattr(gguf_parts, "_check_placements", twin_writes_it_meanwhile)
    try:
        part = resolve_model_path(REPO, needed_layers=(1, 1))
        assert writes[1] == ("twin",) and _span_files() == set()
        assert part == _parts_folder(FILE) / "layers-1-1" / FILE and part.is_file()
    finally:
        release_held_ranges()
