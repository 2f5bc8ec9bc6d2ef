"""Finding a checkpoint (local folder, GGUF file or hub cache), describing it, reading only chosen tensors from it."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint_files import (
    HUB_ALLOW_PATTERNS,
    SAFETENSORS_INDEX_NAME,
    SAFETENSORS_SINGLE_NAME,
    check_full_precision,
    checked_weight_map,
    opened_safetensors,
)
from .errors import CheckpointError
from .hub_ids import HUB_ENDPOINT_ENV, is_hub_gguf_id
from .ollama_models import is_ollama_model, resolve_ollama_model
from .gguf_checkpoint import GGUFCheckpoint, default_read_device, gguf_config, gguf_config_dict, single_gguf_in
from hearth.formats.gguf_support import GGUF_SUFFIX, is_gguf_file

HUB_DOWNLOAD_WORKERS = 4
# Host bytes one read of a tensor that is converted or sent to a GPU stages at most (one row when a row is larger).
STAGING_CHUNK_BYTES = 4 * 1024 * 1024
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelInfo:
    """What a shard advertises and an orchestrator checks about a loaded model."""

    model_id: str
    path: Path
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    tie_word_embeddings: bool
    # Positions the model takes (its config's max_position_embeddings); None when the config does not say.
    max_positions: int | None = None

    @property
    def dtype_name(self) -> str:
        """The compute dtype as a plain string, e.g. "float32" (for events and wire headers)."""
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(dtype: torch.dtype | str | None, config_dtype: torch.dtype | str | None) -> torch.dtype:
    """The compute dtype: an explicit choice, else the checkpoint's own ("auto"), else float32."""
    chosen = config_dtype if dtype is None or dtype == "auto" else dtype
    if chosen is None or chosen == "auto":
        return torch.float32
    if isinstance(chosen, torch.dtype):
        return chosen
    name = str(chosen).removeprefix("torch.").lower()
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {chosen!r}; use one of {sorted(_DTYPE_NAMES)} or 'auto'")
    return _DTYPE_NAMES[name]


def looks_like_local_path(model: str) -> bool:
    """Whether `model` was meant as a folder or file: hub ids are "name" or "org/name", anything else with a path
    shape is not one ("org/name:FILE.gguf" is: one GGUF of a hub repository); an Ollama model is a file here."""
    return (is_ollama_model(model) or model.startswith((".", "/", "~")) or model.count("/") > 1
            or (os.sep != "/" and os.sep in model)
            or (model.lower().endswith(GGUF_SUFFIX) and not is_hub_gguf_id(model)))


def is_local_model(model: str) -> bool:
    """Whether `model` names a model of this machine (a path, a GGUF file, an Ollama model, or nothing at all), as
    opposed to one fetched from elsewhere (a hub id not on disk here): one that cannot be used is the caller's input
    (exit code 2), while a fetched one may fail for now (the network, the broker)."""
    return looks_like_local_path(model) or not model.strip() or _named_here(Path(model).expanduser())


def _named_here(path: Path) -> bool:
    """Whether `path` names an entry of this machine's file system, a symbolic link that leads nowhere (a loop, a
    missing target) included: "loop/a" is then this machine's broken link, not a hub id to look up."""
    return os.path.lexists(path)


def _not_a_checkpoint(path: Path) -> str:
    """Why `path`, given as a local model, is none: missing, a link leading nowhere, or a file that is no GGUF
    (before, the last two were said missing too)."""
    if path.exists():
        return f"{path} is neither a checkpoint folder nor a GGUF file"
    if path.is_symlink():
        return f"{path} is a symbolic link that leads nowhere (a loop, or its target is missing)"
    return f"checkpoint folder or GGUF file {path} does not exist"


def resolve_model_path(
    model: str | Path,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool | None = None,
    needed_layers: tuple[int, int] | str | None = None,
) -> Path:
    """The local folder of a checkpoint given as a folder or a hub id ("org/name", or "org/name:FILE.gguf" for one
    GGUF of a repository holding several), or the GGUF file of one given as a file or an Ollama model
    (`ollama:NAME[:TAG]`, hearth/inference/ollama_models.py).

    With `needed_layers` ((lo, hi) for a shard, "head" for an orchestrator's head) a hub id fetches only the
    files holding those tensors into a partial folder (hearth/inference/hub_fetch.py; a GGUF's tensors by byte ranges);
    a folder is used as it is. A "org/name:FILE.gguf" id without `needed_layers` is that file, downloaded whole.

    A hub id is looked up in the huggingface_hub snapshot cache first (so a machine that already has the
    model starts without any network; a GGUF there too: hearth/inference/hub_cache.py), and downloaded only when it
    is missing and downloads are allowed (``local_files_only`` false and ``HF_HUB_OFFLINE`` unset), like
    ``from_pretrained`` users expect.
    """
    if not isinstance(model, Path) and not model.strip():  # Path("") is the current folder: its checkpoint was served
        raise CheckpointError("no model named: give a checkpoint folder, a GGUF file or a hub model id")
    if is_ollama_model(model):
        return resolve_ollama_model(model).resolve()
    if is_gguf_file(Path(model).expanduser()):
        return Path(model).expanduser().resolve()
    if isinstance(model, Path) or Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
        if not path.is_dir():
            raise CheckpointError(_not_a_checkpoint(path))
        return (single_gguf_in(path) or path).resolve()
    if looks_like_local_path(model) or _named_here(Path(model).expanduser()):
        raise CheckpointError(_not_a_checkpoint(Path(model).expanduser()))

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = local_files_only
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if needed_layers is not None or is_hub_gguf_id(model):
        from .hub_fetch import fetch_hub_selection

        return fetch_hub_selection(model, needed_layers, revision=revision, cache_dir=cache_dir,
                                   local_files_only=offline)
    kwargs = dict(revision=revision, cache_dir=cache_dir, allow_patterns=HUB_ALLOW_PATTERNS,
                  endpoint=os.environ.get(HUB_ENDPOINT_ENV) or None)
    try:
        folder = Path(snapshot_download(model, local_files_only=True, **kwargs))
    except HFValidationError as exc:
        raise CheckpointError(f"{model!r} is neither a checkpoint folder nor a valid hub model id") from exc
    except LocalEntryNotFoundError as exc:
        if offline:
            raise CheckpointError(
                f"model {model!r} is neither a local folder nor in the local hub cache "
                "(and downloads are disabled)"
            ) from exc
        try:
            folder = Path(snapshot_download(model, max_workers=HUB_DOWNLOAD_WORKERS, **kwargs))
        except Exception as exc:  # the hub client raises many network error types; all mean "not available"
            raise CheckpointError(
                f"model {model!r} is neither a local folder nor fetchable from the hub: {exc}"
            ) from exc
    if (folder / "config.json").is_file():
        return folder
    # No config.json: a repository of one GGUF, which the hub cache may hold whole (else it is downloaded whole).
    from .hub_fetch import fetch_hub_selection

    return fetch_hub_selection(model, None, revision=revision, cache_dir=cache_dir, local_files_only=offline)


def models_folder_entry(folder: Path, name: str) -> Path | None:
    """The checkpoint a models folder (`--models-dir`) holds under `name`, as `--model` would load it: a folder
    with a config.json, the one GGUF file of a folder holding one, or the GGUF file `name`.gguf (named by its stem,
    the id its shards advertise); None when it holds none (or a folder of several GGUFs: which to serve is a guess)."""
    entry = folder / name
    if (entry / "config.json").is_file():
        return entry.resolve()
    if entry.is_dir():
        try:
            found = single_gguf_in(entry)
        except CheckpointError:
            return None
        return found.resolve() if found is not None else None
    gguf_file = folder / f"{name}{GGUF_SUFFIX}"
    return gguf_file.resolve() if gguf_file.is_file() else None


def read_config_dict(path: Path) -> dict:
    """The raw config.json of a checkpoint folder, or the same built from a GGUF file's metadata; CheckpointError
    for a folder stored quantized by another library (check_full_precision)."""
    if is_gguf_file(path):
        return gguf_config_dict(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    config = json.loads(config_file.read_text())
    check_full_precision(config, path.name)
    return config


def read_config(path: Path):
    """The transformers config object of a resolved checkpoint: its config.json, or a GGUF file's metadata."""
    from transformers import AutoConfig

    return gguf_config(path) if is_gguf_file(path) else AutoConfig.from_pretrained(path)


def default_model_id(path: Path) -> str:
    """The id a checkpoint is served under when none is given: a GGUF file's stem, a folder's name."""
    return path.stem if is_gguf_file(path) else path.name


def open_checkpoint(path: Path, skeleton: torch.nn.Module) -> SafetensorsCheckpoint | GGUFCheckpoint:
    """The tensor reader of a resolved checkpoint: its safetensors files, or its GGUF under `skeleton`'s names."""
    return GGUFCheckpoint(path, skeleton) if is_gguf_file(path) else SafetensorsCheckpoint(path)


class SafetensorsCheckpoint:
    """Which file holds each tensor of a single-file or sharded safetensors checkpoint; reads tensors by name.

    Only the bytes of the requested tensors are ever touched, through safetensors' memory map (see ``read``);
    ``bytes_read`` counts them as stored.
    """

    def __init__(self, path: Path, *, staging_chunk_bytes: int = STAGING_CHUNK_BYTES):
        self.path = path
        self.staging_chunk_bytes = staging_chunk_bytes
        self.bytes_read = 0
        self._file_of: dict[str, Path] = {}
        index_file = path / SAFETENSORS_INDEX_NAME
        if index_file.is_file():
            weight_map = checked_weight_map(json.loads(index_file.read_text()).get("weight_map"), index_file)
            self._file_of = {name: path / file_name for name, file_name in weight_map.items()}
            return
        files = [path / SAFETENSORS_SINGLE_NAME] if (path / SAFETENSORS_SINGLE_NAME).is_file() else []
        files = files or sorted(path.glob("*.safetensors"))
        if not files and not (path / "config.json").is_file():  # no checkpoint at all (an empty folder)
            raise CheckpointError(f"{path} has no config.json")
        if not files:
            # A folder with a config.json is a safetensors checkpoint's (single_gguf_in), even when it holds a GGUF
            # too, as some hub repositories of GGUFs do: name the file that would serve.
            ggufs = sorted(file for file in path.iterdir() if file.is_file() and file.suffix.lower() == GGUF_SUFFIX)
            raise CheckpointError(f"{path} has no safetensors weights beside its config.json" + (
                f": to serve its GGUF, pass the file {ggufs[0]} as the model" if ggufs
                else " (hearth reads safetensors checkpoints and GGUF files)"))
        for file in files:
            with opened_safetensors(file) as handle:
                for name in handle.keys():
                    self._file_of[name] = file

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    @property
    def file_of(self) -> dict[str, Path]:
        """The file holding each tensor, by name."""
        return dict(self._file_of)

    def weight_files(self) -> list[Path]:
        """The files holding the checkpoint's tensors, in name order."""
        return sorted(set(self._file_of.values()))

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self._file_of)

    def stored_quantized(self, name: str) -> bool:
        """Whether the tensor is stored quantized: never in safetensors checkpoints hearth reads."""
        return False

    def stored_type(self, name: str) -> str:
        """The safetensors dtype the tensor is stored in ("BF16", "F32" ...); CheckpointError when it is missing."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.path}")
        with opened_safetensors(self._file_of[name]) as handle:
            return handle.get_slice(name).get_dtype()

    def stored_int4_group_size(self, name: str) -> int | None:
        """The group of a tensor stored as 4-bit codes in groups (GGUFCheckpoint): none in safetensors."""
        return None

    def read(
        self, names: Iterable[str], dtype: torch.dtype, device: torch.device | str = default_read_device
    ) -> dict[str, torch.Tensor]:
        """The named tensors on `device`, floating ones in `dtype` (others as stored); a missing name is a
        CheckpointError.

        On the CPU a tensor already stored in its final dtype is a zero-copy view of the memory-mapped file (no
        resident memory until compute touches it). Every other tensor is allocated once, in its final dtype on
        `device`, and filled ``staging_chunk_bytes`` of the file at a time (one row when a row is larger), each
        chunk through its own short-lived memory map: closing it unmaps the chunk's pages, which would otherwise
        stay resident in this process until the whole file is unmapped. So besides the result the host holds
        one chunk at a time: never a whole converted tensor, nor (for a GPU) a host copy of the range.
        """
        target_device = torch.device(device)
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            if name not in self._file_of:
                raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.path}")
            by_file[self._file_of[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            with opened_safetensors(file) as mapped:
                for name in file_names:
                    stored = mapped.get_slice(name)
                    shape = stored.get_shape()
                    source = _torch_dtype(stored.get_dtype(), name)
                    final = dtype if source.is_floating_point else source
                    if target_device.type == "cpu" and final == source:
                        tensors[name] = mapped.get_tensor(name)
                    else:
                        tensors[name] = _read_in_chunks(
                            file, name, shape, source, final, target_device, self.staging_chunk_bytes)
                    self.bytes_read += math.prod(shape) * source.itemsize
        return tensors

    def stored_form(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The tensor's shape and stored dtype, from its file's header (none of its data read)."""
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.path}")
        with opened_safetensors(self._file_of[name]) as mapped:
            stored = mapped.get_slice(name)
            return tuple(stored.get_shape()), _torch_dtype(stored.get_dtype(), name)

    def row_chunks(self, name: str, rows_per_chunk: int) -> Iterator[np.ndarray]:
        """The 2-D floating tensor `name`, `rows_per_chunk` rows at a time in float32 (exact for every stored float
        dtype), each chunk through its own memory map as `read` fills a tensor, counted in bytes_read once all are
        read: a caller building its own form of it (an int8 lm_head) never holds it whole in floats."""
        shape, source = self.stored_form(name)
        file = self._file_of[name]
        if len(shape) != 2 or not source.is_floating_point:
            raise CheckpointError(f"tensor {name} is {source} {shape}, not a matrix of floats")
        for first in range(0, shape[0], rows_per_chunk):
            with opened_safetensors(file) as handle:
                yield handle.get_slice(name)[first:first + rows_per_chunk].float().numpy()
        self.bytes_read += math.prod(shape) * source.itemsize


def _torch_dtype(stored_dtype: str, name: str) -> torch.dtype:
    if stored_dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"tensor {name} is stored as {stored_dtype}, which hearth cannot load")
    return SAFETENSORS_DTYPES[stored_dtype]


def _read_in_chunks(file: Path, name: str, shape: list[int], source: torch.dtype, final: torch.dtype,
                    device: torch.device, chunk_bytes: int) -> torch.Tensor:
    """Tensor `name` allocated in `final` on `device`, filled by rows of its first dimension, each chunk read
    through its own memory map of `file` (unmapped when the chunk is copied)."""
    if not shape:
        with opened_safetensors(file) as handle:
            return handle.get_tensor(name).to(device=device, dtype=final)
    result = torch.empty(shape, dtype=final, device=device)
    rows_per_chunk = max(1, chunk_bytes // max(1, math.prod(shape[1:]) * source.itemsize))
    for first in range(0, shape[0], rows_per_chunk):
        last = min(first + rows_per_chunk, shape[0])
        with opened_safetensors(file) as handle:
            result[first:last].copy_(handle.get_slice(name)[first:last])
    return result
