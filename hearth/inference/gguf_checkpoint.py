"""GGUF checkpoints (llama.cpp's single-file format): their HF config and tokenizer, and tensors read by HF name.

A GGUF stores each weight in a llama.cpp block type (F16, Q8_0, Q4_K, ...). hearth dequantizes each tensor it
needs, one at a time, with the gguf package's numpy dequantizers into the shard's dtype, and the loader then
re-quantizes the layer's Linears to the shard's own scheme (``--quantize``, hearth/inference/quantization.py). Keeping
every block type as it is would need matmul kernels torch does not have; the 4-bit ones of groups of 32 (Q4_0,
Q4_1, Q4_K) are the exception: under a quantized scheme they are read as int4 codes (``read_int4_groups``,
hearth/inference/gguf_int4.py; on a CPU ``read_int4_codes``, packed for torch's kernel a chunk of rows at a time) and
held as stored, never re-rounded into more bits. The cost is that a Q4 file served as
``none`` takes full-precision memory, and other quantized blocks under int8/int4 a second rounding (docs/design.md
§12).

Names, the config and the tokenizer come from transformers' own GGUF support (the same name mapping and Q/K row
order its ``from_pretrained(..., gguf_file=...)`` uses), so a GGUF loads into the very layers a safetensors
checkpoint of the same model would. What is parsed from a file's metadata (config, tensor table, tokenizer) is kept
on disk per file version (hearth/inference/gguf_cache.py) and in memory per process; the tensor table is
hearth/inference/gguf_tensor_table.py's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .architectures import adapter_for
from .errors import CheckpointError, first_line
from .file_version import FileVersion, file_version
from .gguf_cache import gguf_cache_entry
from .gguf_config_stand_in import transformers_gguf_config
from .gguf_config import completed_config_of_file
from hearth.formats.gguf_support import FLOAT_GGUF_TYPE_NAMES, GGUF_SUFFIX, SUPPORTED_GGUF_ARCHITECTURES, is_gguf_file
from .gguf_header import checked_gguf_header, read_gguf_header
from .gguf_layout import SplitGGUFError, check_block_types
from .gguf_int4 import STORED_INT4_GROUP_SIZES, int4_groups_of_blocks
from .gguf_tensor_table import METADATA_CACHE_ENTRIES, StoredTensor, gguf_package, gguf_table
from .weight_codes import Int4Codes, Int4Groups, packed_int4_codes

# Where a checkpoint reader puts the tensors it reads unless told (the loader asks for its device).
default_read_device = "cpu"
# The HF model types the architectures hearth serves (gguf_support.SUPPORTED_GGUF_ARCHITECTURES) load as.
SUPPORTED_GGUF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# What each parse is stored as in a file's disk cache entry (hearth/inference/gguf_cache.py).
CONFIG_CACHE_NAME = "config"
TOKENIZER_CACHE_NAME = "tokenizer"


def single_gguf_in(folder: Path) -> Path | None:
    """The one GGUF file of a folder that has no config.json (named *.gguf, else told by its magic), None when it
    has none; several are refused (which one to serve would be a guess)."""
    if (folder / "config.json").is_file():
        return None
    # Files named *.gguf first: a partial download or staging file beside one (still GGUF inside) is not a second.
    files = sorted(p for p in folder.iterdir() if p.is_file())
    found = [p for p in files if p.suffix.lower() == GGUF_SUFFIX] or [p for p in files if is_gguf_file(p)]
    if len(found) > 1:
        try:  # the parts of one split GGUF, of which no file serves, are refused as such
            read_gguf_header(found[0])
        except SplitGGUFError:
            raise
        except CheckpointError:
            pass  # a truncated or corrupt file: which one to serve is still the question
        names = ", ".join(p.name for p in found)
        raise CheckpointError(f"{folder} holds several GGUF files ({names}); pass the one to serve as --model")
    return found[0] if found else None


def gguf_config_dict(path: Path) -> dict:
    """The HF config of a GGUF as a plain dict (what config.json would hold), from its metadata alone (through
    transformers' ``AutoConfig.from_pretrained(..., gguf_file=...)`` of a stand-in without the vocabulary,
    hearth/inference/gguf_config_stand_in.py); parsed once per file version, then read from the disk cache."""
    path = Path(path).resolve()
    return dict(_cached_config(str(path), file_version(path.stat())))


@functools.lru_cache(maxsize=METADATA_CACHE_ENTRIES)
def _cached_config(path_text: str, version: FileVersion) -> dict:
    entry = gguf_cache_entry(path_text)
    with entry.parsing(CONFIG_CACHE_NAME):
        cached = entry.read_json(CONFIG_CACHE_NAME)
        if isinstance(cached, dict):
            return cached
        # Through JSON even when just parsed, so a parsed and a cached config are the same dict (lists, not tuples).
        config = json.loads(json.dumps(parsed_gguf_config(Path(path_text))))
        entry.write_json(CONFIG_CACHE_NAME, config)
        return config


def parsed_gguf_config(path: Path) -> dict:
    """The HF config of the GGUF at `path` parsed from its metadata (its header checked first), with no cache read or
    written (`hearth doctor` reads only); CheckpointError (one line) for a file hearth does not serve."""
    header = checked_gguf_header(path)
    supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
    try:
        config = transformers_gguf_config(path, header)
    except Exception as exc:  # transformers' reader and its config checks raise many kinds (struct.error and others)
        raise CheckpointError(
            f"{path.name} is not a GGUF hearth can read (truncated, corrupt, or an architecture other than "
            f"{supported}): {first_line(exc)}"
        ) from None
    if config.model_type not in SUPPORTED_GGUF_MODEL_TYPES:
        raise CheckpointError(
            f"GGUF {path.name} holds a {config.model_type!r} model; hearth serves {supported} GGUFs "
            "(Mistral is written as llama)"
        )
    raw = config.to_dict()
    raw["architectures"] = raw.get("architectures") or [adapter_for(config).architecture]
    return completed_config_of_file(raw, path)  # what transformers' reader leaves out


def gguf_config(path: Path):
    """The transformers config object of a GGUF (see gguf_config_dict)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**gguf_config_dict(path))


def load_gguf_tokenizer(path: Path):
    """The tokenizer (with its chat template) stored in the GGUF's metadata, via transformers; after the first load
    of a file version, from the copy saved in its disk cache entry."""
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    entry = gguf_cache_entry(path)
    saved = entry.saved_folder(TOKENIZER_CACHE_NAME)
    if saved is not None:
        try:
            return AutoTokenizer.from_pretrained(saved)
        except (OSError, ValueError, KeyError, TypeError):
            entry.discard_folder(TOKENIZER_CACHE_NAME)  # damaged: replaced by a fresh copy below
    tokenizer = _parsed_tokenizer(path)
    entry.save_folder(TOKENIZER_CACHE_NAME, tokenizer.save_pretrained)
    return tokenizer


def _parsed_tokenizer(path: Path):
    """The GGUF's tokenizer built by transformers from the file, of the class AutoTokenizer would pick. Where nothing
    but the model's type names that class, it is taken from the config this module parsed without the vocabulary
    (gguf_config_dict), and the vocabulary is read once, by the tokenizer: AutoTokenizer itself reads a llama-family
    file's config through the gguf package's reader, which decodes the whole vocabulary a second time (BENCHMARKS.md,
    "GGUF start-up")."""
    from transformers import AutoTokenizer

    tokenizer_class = _tokenizer_class_by_model_type(path) or AutoTokenizer
    return tokenizer_class.from_pretrained(path.parent, gguf_file=path.name)


def _tokenizer_class_by_model_type(path: Path):
    """The tokenizer class AutoTokenizer maps the GGUF's model type to (its rule when neither a tokenizer_config.json
    beside the file nor the config names one), or None where another of its rules could apply: a class named there,
    or Mistral's own tokenizer format."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING, get_tokenizer_config
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    config = gguf_config(path)
    if getattr(config, "tokenizer_class", None) or get_tokenizer_config(path.parent):
        return None
    tokenizer_class = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return None if tokenizer_class is None or tokenizer_class.__name__ == "MistralCommonBackend" else tokenizer_class


def _gguf_to_hf_names(model: nn.Module, architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name for every tensor of `model`, through the gguf package's name map (the mapping
    transformers' get_gguf_hf_weights_map applies, built once instead of once per submodule)."""
    gguf = gguf_package()
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    mapping = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            mapping[f"{gguf_base}.{suffix}"] = hf_name
    return mapping


class GGUFCheckpoint:
    """A GGUF file read tensor by tensor under the HF names of `model` (a meta-device skeleton of the same config).
    Same interface as SafetensorsCheckpoint: ``__contains__``, ``names()``, ``read()``; ``bytes_read`` counts the
    stored (quantized) bytes of what was read.

    The tensor table comes from the file's header (gguf_table); each tensor's bytes are then read
    through a memory map of just that tensor, closed once it is dequantized, so a shard's process keeps no mapping
    of the file (none of its pages count in its memory) once loaded.
    """

    def __init__(self, path: Path, model: nn.Module):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = path
        self.bytes_read = 0
        self._table = gguf_table(path)
        config = gguf_config_dict(path)
        # transformers' processors undo what llama.cpp's converter did to a tensor (for llama: it permutes Q and K
        # rows into its own rotary layout; qwen2 keeps HF's).
        self._processor = TENSOR_PROCESSORS.get(self._table.architecture, TensorProcessor)(config=config)
        hf_name_of = _gguf_to_hf_names(model, self._table.architecture, config["num_hidden_layers"])
        self._tensor_of = {hf_name_of[t.name]: t for t in self._table.tensors if t.name in hf_name_of}
        self._config_shape_of = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}

    def __contains__(self, name: str) -> bool:
        return name in self._tensor_of

    def names(self) -> set[str]:
        """Every HF tensor name the GGUF holds."""
        return set(self._tensor_of)

    def weight_files(self) -> list[Path]:
        """The files holding the checkpoint's tensors: the GGUF."""
        return [self.path]

    def stored_quantized(self, name: str) -> bool:
        """Whether the tensor is stored in a quantized block type (not F32/F16/BF16/F64)."""
        return self._stored(name).block_type.name not in FLOAT_GGUF_TYPE_NAMES

    def stored_type(self, name: str) -> str:
        """The GGUF block type name the tensor is stored in ("Q4_K", "F16" ...)."""
        return self._stored(name).block_type.name

    def stored_int4_group_size(self, name: str) -> int | None:
        """The group of input features a tensor stored as 4-bit codes in groups has (read_int4_groups reads it
        so), None for any other storage."""
        stored = self._stored(name)
        return STORED_INT4_GROUP_SIZES.get(stored.block_type.name) if len(stored.shape) == 2 else None

    def read_int4_groups(self, name: str, device: torch.device | str = default_read_device) -> Int4Groups:
        """A 2-D tensor stored in a 4-bit block type (stored_int4_group_size) as its codes, scales and minimums on
        `device`, rows in HF order; nothing is re-rounded."""
        stored = self._stored(name)
        if self.stored_int4_group_size(name) is None:
            raise CheckpointError(f"tensor {stored.name} of {self.path.name} is stored as {stored.block_type.name}, "
                                  "not in 4-bit groups")
        rows = stored.shape[0]
        blocks = np.array(self._stored_bytes(stored)).reshape(-1, gguf_package().GGML_QUANT_SIZES[stored.block_type][1])
        parts = [self._processor.process(weights=part.reshape(rows, -1), name=stored.name).weights
                 for part in int4_groups_of_blocks(blocks, stored.block_type.name)]
        codes, scales, minimums = (torch.from_numpy(np.ascontiguousarray(part)).to(device) for part in parts)
        self.bytes_read += int(stored.n_bytes)
        return Int4Groups(codes, scales, minimums)

    def read_stored_int4(self, name: str, device: torch.device) -> Int4Groups | Int4Codes:
        """A 2-D tensor stored in a 4-bit block type as QuantizedLinear takes it on `device`: read_int4_codes on the
        CPU, read_int4_groups elsewhere."""
        return self.read_int4_codes(name) if device.type == "cpu" else self.read_int4_groups(name, device)

    def read_int4_codes(self, name: str) -> Int4Codes:
        """What ``read_int4_groups(name).packed_for_cpu()`` gives, bit for bit, read and packed a chunk of rows at a
        time: the weight's codes are never held whole unpacked (BENCHMARKS.md, "GGUF start-up")."""
        stored = self._stored(name)
        group_size = self.stored_int4_group_size(name)
        hf_order = self._hf_row_order(stored)
        if group_size is None or hf_order is None:  # read_int4_groups says why it cannot, or reads it whole
            return self.read_int4_groups(name).packed_for_cpu()
        block_bytes = gguf_package().GGML_QUANT_SIZES[stored.block_type][1]
        blocks = self._stored_bytes(stored).reshape(stored.shape[0], -1, block_bytes)

        def rows_codes(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
            chunk = blocks[hf_order[first:last]].reshape(-1, block_bytes)  # reads only those rows' pages
            parts = int4_groups_of_blocks(chunk, stored.block_type.name)
            codes, scales, minimums = (torch.from_numpy(part.reshape(last - first, -1)) for part in parts)
            return Int4Groups(codes, scales, minimums).kernel_form(0, last - first)

        packed = packed_int4_codes(stored.shape, group_size, rows_codes)
        self.bytes_read += int(stored.n_bytes)
        return packed

    def _hf_row_order(self, stored: StoredTensor) -> np.ndarray | None:
        """Which stored row each of the tensor's rows in HF order is, None where transformers' processor does more
        to the tensor than reorder its rows (blocks never span rows, so a row's codes are its blocks')."""
        rows = stored.shape[0]
        order = self._processor.process(weights=np.arange(rows).reshape(rows, 1), name=stored.name).weights
        if not isinstance(order, np.ndarray) or order.shape != (rows, 1):
            return None
        order = order.reshape(rows)
        return order if np.array_equal(np.sort(order), np.arange(rows)) else None

    def stored_form(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The tensor's shape and the dtype its values are read in (float32: every block type is dequantized), from
        the file's header (none of its data read)."""
        return tuple(self._stored(name).shape), torch.float32

    def row_reader(self, name: str) -> Callable[[np.ndarray], np.ndarray]:
        """A reader of rows of the 2-D tensor `name`: given row indices (HF's order: a llama file's Q and K rows
        are read from where its rotary order stores them), those rows as float32, read from the memory-mapped file
        and dequantized row by row (blocks never span rows), each exactly as `read` gives it."""
        stored = self._stored(name)
        check_block_types([(stored.name, stored.block_type.name)], self.path.name)
        data = self._stored_bytes(stored).view(stored.stored_dtype).reshape(stored.stored_shape)
        hf_order = self._hf_row_order(stored) if len(stored.shape) == 2 else None
        if hf_order is None or data.shape[0] != stored.shape[0]:
            raise CheckpointError(f"tensor {stored.name} of {self.path.name} is not stored in rows")

        def rows(indices: np.ndarray) -> np.ndarray:
            values = self._stored_values(stored, data[hf_order[indices]])  # reads only those rows' pages
            return np.ascontiguousarray(values, dtype=np.float32)

        return rows

    def row_chunks(self, name: str, rows_per_chunk: int) -> Iterator[np.ndarray]:
        """The 2-D tensor `name` read whole, `rows_per_chunk` rows at a time (float32, each chunk exactly as `read`
        gives those rows) and counted in bytes_read once all are read: a caller building its own copy of it (a
        float16 lm_head) never holds it whole in float32."""
        read_rows, stored = self.row_reader(name), self._stored(name)
        for lo in range(0, stored.shape[0], rows_per_chunk):
            yield read_rows(np.arange(lo, min(stored.shape[0], lo + rows_per_chunk)))
        self.bytes_read += int(stored.n_bytes)

    def stop_token_ids(self) -> set[int]:
        """End-of-generation token ids the GGUF names (eos, end of turn, end of message)."""
        return set(self._table.stop_token_ids)

    def read(
        self, names: Iterable[str], dtype: torch.dtype, device: torch.device | str = default_read_device
    ) -> dict[str, torch.Tensor]:
        """The named tensors on `device` in `dtype`, each dequantized on its own (besides the result the host holds
        one float32 copy of one tensor at a time); a missing name or a storage type hearth does not read is a
        CheckpointError raised before any tensor is read."""
        names = list(names)
        held = [self._stored(name) for name in names]
        check_block_types(((stored.name, stored.block_type.name) for stored in held), self.path.name)
        target_device = torch.device(device)
        tensors: dict[str, torch.Tensor] = {}
        for name, stored in zip(names, held, strict=True):
            tensors[name] = torch.from_numpy(self._dequantized(stored)).to(device=target_device, dtype=dtype)
            self.bytes_read += int(stored.n_bytes)
        return tensors

    def _stored(self, name: str) -> StoredTensor:
        """The GGUF's tensor behind HF name `name`; CheckpointError when the file lacks it or holds it in another
        shape than the config's (before its values are read: transformers reorders Q and K by the head counts)."""
        stored = self._tensor_of.get(name)
        if stored is None:
            raise CheckpointError(f"tensor {name} is missing from the GGUF {self.path.name}")
        if stored.shape != (expected := self._config_shape_of[name]):
            raise CheckpointError(f"tensor {stored.name} of {self.path.name} is {stored.shape}, where the model's "
                                  f"config makes {name} {expected}")
        return stored

    def _stored_bytes(self, stored: StoredTensor) -> np.memmap:
        """The tensor's bytes as the file holds them, memory-mapped (read only when used)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=stored.data_offset, shape=(stored.n_bytes,))

    def _dequantized(self, stored: StoredTensor) -> np.ndarray:
        values = self._values(stored, self._stored_bytes(stored).view(stored.stored_dtype).reshape(stored.stored_shape))
        if not (values.flags.writeable and values.flags.c_contiguous):
            # A tensor stored as plain floats is a read-only view of the memory map: copy it out of the file.
            values = np.array(values, order="C", copy=True)
        return values

    def _values(self, stored: StoredTensor, data: np.ndarray) -> np.ndarray:
        """The values of `data` (the stored tensor's array) dequantized and in HF's layout."""
        return self._processor.process(weights=self._stored_values(stored, data), name=stored.name).weights

    def _stored_values(self, stored: StoredTensor, data: np.ndarray) -> np.ndarray:
        """The values of `data` (the stored tensor's array, or some of its rows) dequantized, in the file's layout."""
        if data.dtype.kind == "f":
            values = data  # F32, F16, F64 are numpy's own floats (the gguf package has no F64 dequantizer)
        else:
            try:
                values = gguf_package().quants.dequantize(data, stored.block_type)
            except (ValueError, NotImplementedError) as exc:
                raise CheckpointError(
                    f"tensor {stored.name} of {self.path.name} cannot be dequantized: {exc}") from None
        return values
