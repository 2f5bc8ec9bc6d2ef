"""Reading a hub repository's GGUF by HTTP byte ranges: its header to size a range, and only the tensors a layer
range (or the head) needs, written as a partial GGUF the loader reads.

The header is read from the file's start in growing ranges until its tensor table parses (bounded by
MAX_GGUF_HEADER_BYTES); it is kept on disk, so sizing and loading read it once. A part's tensors are fetched as
byte spans, neighbouring tensors coalesced into one request whatever order the file stores them in, each span
resumable after an interruption and shown on a progress bar, then written with the header's metadata as a GGUF
of only those tensors (hearth/inference/gguf_parts.py), in a folder whose PARTIAL_CHECKPOINT_MARKER states the whole
file's digest: hosts holding the whole file, its ranged parts or its parts from the community's store form one
pipeline.

What is left behind is removed as cache_ranges.py removes a layer range's folder, under its locks: once a part is
written, the part folders no process holds, and the span files no part still being fetched by a process that holds it
needs; those of parts written go at once, an interrupted part's once untouched for STALE_SPAN_S (a restart within it
resumes them); a process still fetching a part that a twin process wrote first takes the twin's folder. With the
file downloaded whole, which serves every range, the parts no process holds and every span file go (unless a process
still fetches a part).

What is trusted: a partial read cannot be checked against the file's SHA-256 (the hub lists only the whole file's),
and a GGUF carries no per-tensor checksums. Every request names the commit, whose files never change, and each
ranged answer must state the listed file size (Content-Range); the header must parse, every tensor lie inside the
file and the written part read back as a GGUF. Beyond that the bytes are the hub's (over TLS), as they are for a
whole-file download until it is hashed; a household that needs more publishes the file into its community store
(per-part SHA-256 in the manifest) or downloads it whole.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .cache_ranges import SELECTION_NAME, needed_of, remove_superseded_ranges
from .checksum import GGUF_DIGEST_NAME, digest_of_files
from .errors import CheckpointError
from .gguf_header import MAX_GGUF_HEADER_BYTES, HeaderIncomplete, ParsedGGUFHeader, parse_gguf_header
from .gguf_layout import EVERY_LAYER_TENSORS, GGUFPartTensor
from .gguf_parts import StoredLayout, TensorPlacement, write_gguf_folder, write_gguf_part
from .hub_download import PARTIAL_SUFFIX, TRANSFER_RETRIES, byte_progress, is_sized, lock_after_twin
from .hub_ids import HUB_ENDPOINT_ENV
from .partial_checkpoint import NeededTensors, complete_partial_folder, selection_name

# The first read of a header, and how much each further read grows it: real vocabularies make headers of a few MB.
HEADER_FIRST_READ_BYTES = 64 << 10
HEADER_GROWTH_FACTOR = 4
# Needed tensors closer than this in the file are fetched in one request (llama.cpp pads tensors to 32 bytes).
COALESCE_GAP_BYTES = 4096
HEADER_FILE = "header.bin"
METADATA_FOLDER = "metadata"
SPANS_FOLDER = "spans"
# How long an interrupted part's span files, which no process fetching a part needs, are kept for a restart to resume.
STALE_SPAN_S = 24 * 3600.0
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class RangesUnsupported(CheckpointError):
    """The server answered a byte-range request with something else (the whole file, or no size): read it whole."""


@dataclass(frozen=True)
class HubGGUF:
    """One GGUF of a hub repository at a commit, with its listed size and SHA-256, and the folder its ranged parts
    are kept in."""

    repo_id: str
    file: str
    commit: str
    size: int
    sha256: str
    folder: Path

    @property
    def url(self) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, self.file, revision=self.commit,
                          endpoint=os.environ.get(HUB_ENDPOINT_ENV) or None)

    @property
    def weights_sha256(self) -> str:
        """The digest every host serving this file states (as inference.checksum.weights_sha256 of the file)."""
        return digest_of_files([(GGUF_DIGEST_NAME, self.size, self.sha256)])

    @property
    def source(self) -> str:
        return f"hub:{self.repo_id}@{self.commit}/{self.file}"


def gguf_header(hub: HubGGUF) -> tuple[ParsedGGUFHeader, bytes]:
    """The parsed header of `hub`'s file and its bytes: read from disk when kept, else by growing ranges from the
    file's start. CheckpointError (one line) when it is no GGUF hearth reads or exceeds MAX_GGUF_HEADER_BYTES."""
    kept = hub.folder / HEADER_FILE
    if kept.is_file():
        buffer = kept.read_bytes()
        with contextlib.suppress(HeaderIncomplete):
            return parse_gguf_header(buffer, hub.size, hub.file), buffer
    buffer, wanted = b"", min(HEADER_FIRST_READ_BYTES, hub.size)
    while True:
        if wanted > len(buffer):
            out = io.BytesIO()
            _fetch_range(hub, len(buffer), wanted - 1, out, None)
            buffer += out.getvalue()
        try:
            parsed = parse_gguf_header(buffer, hub.size, hub.file)
            break
        except HeaderIncomplete as short:
            if short.needed > min(MAX_GGUF_HEADER_BYTES, hub.size):
                raise CheckpointError(
                    f"{hub.file}'s header is longer than {min(MAX_GGUF_HEADER_BYTES, hub.size)} bytes (its file's "
                    "size, or hearth's bound on a GGUF header): not a GGUF hearth reads") from None
            wanted = min(max(short.needed, len(buffer) * HEADER_GROWTH_FACTOR), MAX_GGUF_HEADER_BYTES, hub.size)
    buffer = buffer[:parsed.split.header_bytes]
    _write_atomically(kept, buffer)
    return parsed, buffer


def gguf_metadata_file(hub: HubGGUF, parsed: ParsedGGUFHeader, header: bytes) -> Path:
    """A GGUF holding `hub`'s metadata (its header `parsed` from `header`, gguf_header) and no tensor, for what is
    read from metadata alone (its config); written again when the one there is not its size (cut short since by a
    crash: renamed into place whole, its bytes may not have reached the disk)."""
    target = hub.folder / METADATA_FOLDER / hub.file
    split = parsed.split
    # A GGUF of no tensor is the header up to its tensor infos, padded to the alignment (write_gguf_part).
    if not is_sized(target, -(-split.kv_end // split.alignment) * split.alignment):
        write_gguf_part(target, header, split.kv_end, split.alignment, [])
    return target


def cached_gguf_part(hub_folder: Path, file: str, needed: NeededTensors) -> Path | None:
    """The part of `file` for `needed` written earlier into `hub_folder`, None when there is none."""
    folder = complete_partial_folder(hub_folder / selection_name(needed))
    return None if folder is None else folder / file


def fetch_gguf_part(hub: HubGGUF, needed: NeededTensors) -> Path:
    """A GGUF of `hub`'s tensors that `needed` asks for ((lo, hi): those decoder layers, "head": every other
    tensor) with its whole metadata, beside a marker stating the whole file's digest. RangesUnsupported when the
    server does not serve byte ranges; CheckpointError (one line) for a file hearth does not read or a range that
    holds no tensor."""
    if (done := cached_gguf_part(hub.folder, hub.file, needed)) is not None:
        return done
    parsed, header = gguf_header(hub)
    wanted = [tensor for tensor in parsed.split.tensors if _is_wanted(tensor, needed)]
    if not wanted:
        raise CheckpointError(f"{hub.file} holds no tensors of {selection_name(needed)}")
    spans = coalesced_spans(wanted)
    files = {HEADER_FILE: hub.folder / HEADER_FILE}
    missing = [(first, last) for first, last in spans if not is_sized(_span_file(hub, first, last), last - first + 1)]
    with byte_progress(sum(last - first + 1 for first, last in missing),
                       f"{hub.file} {selection_name(needed)}") as bar:
        for first, last in spans:
            files[_span_name(first, last)] = _fetch_span(hub, first, last, bar)
    placements = []
    for tensor in wanted:  # in the file's order, as the tensor table lists them
        first = next(first for first, last in spans if first <= tensor.data_start <= last)
        placements.append(TensorPlacement(tensor.name, _span_name(first, _last_of(spans, first)),
                                          tensor.data_start - first, tensor.n_bytes, tensor.info_start,
                                          tensor.info_end))
    layout = StoredLayout(parsed.split.kv_end, parsed.split.alignment, placements)
    # Its span files stay until remove_part_leftovers: another process's part may need the same span.
    try:
        return write_gguf_folder(hub.folder / selection_name(needed), hub.file, HEADER_FILE, layout, files,
                                 weights_sha256=hub.weights_sha256, source=hub.source)
    except FileNotFoundError:
        # A twin process writing the same part finished first and removed the spans this one was reading.
        if (done := cached_gguf_part(hub.folder, hub.file, needed)) is not None:
            return done
        raise


def remove_part_leftovers(parts_folder: Path, parsed: ParsedGGUFHeader | None, written: NeededTensors) -> None:
    """Remove from `parts_folder` (a GGUF's ranged parts) the part folders no process holds, the one for `written`
    just written counted as held, and the span files no part that a process holds and still fetches needs: those of
    parts written at once, others once untouched for STALE_SPAN_S. `parsed` None: the file is here whole, so every
    span file goes unless a held part is still being fetched. Best effort, as cache_ranges.remove_superseded_ranges."""
    if not parts_folder.is_dir():
        return
    spans = parts_folder / SPANS_FOLDER
    written_name = None if parsed is None else selection_name(written)
    present = {entry.name for entry in spans.iterdir()} if spans.is_dir() else set()
    if parsed is None:
        removable = present
    else:
        built = set().union(*(span_files_of(parsed, needed_of(folder.name)) for folder in parts_folder.iterdir()
                              if SELECTION_NAME.match(folder.name) and folder.name != selection_name(None)
                              and complete_partial_folder(folder)))
        removable = {name for name in present if name in built or _untouched_for(spans / name, STALE_SPAN_S)}

    def kept_or_removable(needed: NeededTensors) -> set[str]:
        if needed is None:  # asked for the candidates (a parts folder holds no "all" part)
            return removable
        if complete_partial_folder(parts_folder / selection_name(needed)) is not None:
            return set()
        return present if parsed is None else span_files_of(parsed, needed)

    remove_superseded_ranges(parts_folder, [parts_folder], spans, kept_or_removable, written=written_name)


def span_files_of(parsed: ParsedGGUFHeader, needed: NeededTensors) -> set[str]:
    """The span files, done and partial, that fetching the part for `needed` of the file `parsed` reads or writes."""
    spans = coalesced_spans([tensor for tensor in parsed.split.tensors if _is_wanted(tensor, needed)])
    return {name for first, last in spans
            for name in (_span_name(first, last), _span_name(first, last, PARTIAL_SUFFIX))}


def layer_tensor_shapes_of(parsed: ParsedGGUFHeader) -> list[tuple[str, str, list[int]]]:
    """(name, GGUF block type, shape) of every decoder layer tensor, as hearth/inference/memory.py's
    layer_weight_bytes_of counts them (and hub_fetch's layout of a whole GGUF)."""
    return [(f"layers.{tensor.layer}.{tensor.name}", tensor.block_type, list(tensor.shape))
            for tensor in parsed.split.tensors if tensor.layer is not None]


def coalesced_spans(tensors: list[GGUFPartTensor]) -> list[tuple[int, int]]:
    """Byte spans (first, last, inclusive) covering `tensors`' bytes, tensors closer than COALESCE_GAP_BYTES in one
    span, in file order whatever order `tensors` come in."""
    spans: list[list[int]] = []
    for tensor in sorted(tensors, key=lambda t: t.data_start):
        end = tensor.data_start + tensor.n_bytes - 1
        if spans and tensor.data_start - spans[-1][1] - 1 <= COALESCE_GAP_BYTES:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([tensor.data_start, end])
    return [(first, last) for first, last in spans]


def _is_wanted(tensor: GGUFPartTensor, needed: NeededTensors) -> bool:
    if needed == "head":
        return tensor.layer is None
    if tensor.name in EVERY_LAYER_TENSORS:
        return True
    return tensor.layer is not None and needed[0] <= tensor.layer <= needed[1]


def _last_of(spans: list[tuple[int, int]], first: int) -> int:
    return next(last for start, last in spans if start == first)


def _span_name(first: int, last: int, suffix: str = ".bin") -> str:
    return f"{first}-{last}{suffix}"


def _untouched_for(file: Path, age_s: float) -> bool:
    try:
        return time.time() - file.stat().st_mtime >= age_s
    except OSError:  # removed meanwhile
        return False


def _span_file(hub: HubGGUF, first: int, last: int) -> Path:
    return hub.folder / SPANS_FOLDER / _span_name(first, last)


def _fetch_span(hub: HubGGUF, first: int, last: int, bar) -> Path:
    """The span's bytes in its file, resumed from what an interrupted fetch left; the partial file is locked while
    it grows, so two hosts on one machine never write it together, and one waits for the other only while the
    partial file grows (CheckpointError, one line, once it has stalled)."""
    done = _span_file(hub, first, last)
    if is_sized(done, last - first + 1):
        return done
    done.parent.mkdir(parents=True, exist_ok=True)
    partial = done.with_name(_span_name(first, last, PARTIAL_SUFFIX))
    with partial.open("ab") as out:
        lock_after_twin(out, partial, hub.repo_id, f"{hub.file} bytes {first}-{last}")  # released when closed
        if is_sized(done, last - first + 1):  # a twin finished it while this one waited
            return done
        done.unlink(missing_ok=True)  # cut short since it was finished: fetched again
        have = out.seek(0, os.SEEK_END)
        if bar is not None:
            bar.update(have)
        if have < last - first + 1:
            _fetch_range(hub, first + have, last, out, bar)
        out.flush()
        if out.tell() != last - first + 1:
            raise CheckpointError(f"{hub.file}: bytes {first}-{last} arrived with {out.tell()} bytes")
        os.replace(partial, done)
    return done


def _fetch_range(hub: HubGGUF, first: int, last: int, out, bar) -> None:
    """Write bytes first..last of `hub`'s file to `out`, resuming after a broken transfer (TRANSFER_RETRIES times)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    position, retries = first, TRANSFER_RETRIES
    while position <= last:
        try:
            headers = {**build_hf_headers(), "Range": f"bytes={position}-{last}"}
            with get_session().stream("GET", hub.url, headers=headers, follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                _check_ranged_answer(hub, response, position, last)
                for chunk in response.iter_bytes():
                    chunk = chunk[:last - position + 1]
                    out.write(chunk)
                    position += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                    if position > last:
                        break  # a server sending on past the range is not read without end
        except (httpx2.TransportError, httpx2.StreamError):
            if retries == 0:
                raise
            retries -= 1
        else:
            if position <= last:
                raise CheckpointError(f"{hub.file}: the answer for bytes {position}-{last} ended early")


def _check_ranged_answer(hub: HubGGUF, response, first: int, last: int) -> None:
    found = CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
    if response.status_code != 206 or found is None:
        raise RangesUnsupported(f"{hub.url} answered a byte-range request with status {response.status_code} "
                                "and no Content-Range")
    if (int(found.group(1)), int(found.group(2))) != (first, last) or found.group(3) not in ("*", str(hub.size)):
        raise CheckpointError(f"{hub.file}: asked for bytes {first}-{last} of {hub.size}, the server sent "
                              f"{response.headers['Content-Range']} (a different file than listed?)")


def _write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    staging.write_bytes(data)
    os.replace(staging, target)

