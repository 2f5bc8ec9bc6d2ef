"""Models Ollama has pulled onto this machine, named as Ollama names them (`ollama:NAME[:TAG]`): the GGUF blob that
holds a model's weights, found through Ollama's manifest without Ollama running.

Ollama keeps each model as a manifest, `<models>/manifests/<registry>/<namespace>/<model>/<tag>` (JSON, an OCI image
manifest), whose layer of media type `application/vnd.ollama.image.model` names the weights' blob by its digest,
`<models>/blobs/sha256-<hex>`: a GGUF file. `<models>` is $OLLAMA_MODELS, else `~/.ollama/models`, else the Linux
service's `/usr/share/ollama/.ollama/models`. A name is `[registry/][namespace/]model[:tag]`, with Ollama's
defaults `registry.ollama.ai`, `library` and `latest` (`gemma3:4b`,
`hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .errors import CheckpointError

OLLAMA_MODEL_PREFIX = "ollama:"
OLLAMA_MODELS_ENV = "OLLAMA_MODELS"
OLLAMA_MODELS_DIRS = (Path("~/.ollama/models"), Path("/usr/share/ollama/.ollama/models"))
OLLAMA_DEFAULT_REGISTRY = "registry.ollama.ai"
OLLAMA_DEFAULT_NAMESPACE = "library"
OLLAMA_DEFAULT_TAG = "latest"
OLLAMA_WEIGHTS_MEDIA_TYPE = "application/vnd.ollama.image.model"
OLLAMA_ADAPTER_MEDIA_TYPE = "application/vnd.ollama.image.adapter"
# A manifest lists a handful of layers; anything far larger is not one.
MAX_MANIFEST_BYTES = 1 << 20
MAX_NAME_CHARS = 256
# Each part of a name becomes a folder name under the manifests folder: no separators, and no "." or "..".
_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A registry may name its port (`localhost:5000/ns/model`), as Ollama's folder for it does.
_REGISTRY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(:[0-9]{1,5})?")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def is_ollama_model(model: object) -> bool:
    """Whether `model` names a model pulled by Ollama (`ollama:NAME[:TAG]`)."""
    return isinstance(model, str) and model.startswith(OLLAMA_MODEL_PREFIX)


def ollama_manifest_parts(model: str) -> tuple[str, str, str, str]:
    """(registry, namespace, model, tag) of `ollama:NAME[:TAG]`; CheckpointError (one line) for a malformed name."""
    name = model[len(OLLAMA_MODEL_PREFIX):] if is_ollama_model(model) else model
    tagged = ":" in name.rpartition("/")[2]
    path, _, tag = name.rpartition(":") if tagged else (name, "", OLLAMA_DEFAULT_TAG)
    parts = path.split("/")
    if not 1 <= len(parts) <= 3 or len(name) > MAX_NAME_CHARS:
        raise CheckpointError(f"{model!r} is not an Ollama model name ([registry/][namespace/]model[:tag])")
    registry, namespace = OLLAMA_DEFAULT_REGISTRY, OLLAMA_DEFAULT_NAMESPACE
    if len(parts) == 3:
        registry, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    resolved = (registry, namespace, parts[-1], tag)
    if not (_REGISTRY.fullmatch(registry) and all(_NAME_PART.fullmatch(part) for part in resolved[1:])):
        raise CheckpointError(f"{model!r} is not an Ollama model name ([registry/][namespace/]model[:tag])")
    return resolved


def ollama_models_dir() -> Path:
    """Where Ollama keeps its models: $OLLAMA_MODELS, else the first of OLLAMA_MODELS_DIRS that exists."""
    if configured := os.environ.get(OLLAMA_MODELS_ENV):
        return Path(configured).expanduser()
    candidates = [folder.expanduser() for folder in OLLAMA_MODELS_DIRS]
    return next((folder for folder in candidates if _exists(folder)), candidates[0])


def _exists(folder: Path) -> bool:
    """Whether `folder` is there, readable or not (an unreadable one is Ollama's, and reading it says so)."""
    try:
        return folder.is_dir()
    except PermissionError:
        return True


def served_model_id(model: str) -> str:
    """The id a model string given as --model is served under when it is not a path: an Ollama model's canonical
    name (canonical_ollama_name), anything else (a hub id) as given."""
    return canonical_ollama_name(model) if is_ollama_model(model) else model


def canonical_ollama_name(model: str) -> str:
    """`ollama:NAME:TAG` as Ollama shows it (its default registry and namespace left out, the tag given): the id
    every spelling of one model is served under, so `ollama:gemma3` and `ollama:library/gemma3:latest` agree."""
    return OLLAMA_MODEL_PREFIX + ollama_short_name(*ollama_manifest_parts(model))


def resolve_ollama_model(model: str, models_dir: Path | None = None) -> Path:
    """The GGUF blob of the Ollama model `model` (`ollama:NAME[:TAG]`) on this machine; CheckpointError (one line)
    when Ollama has not pulled it or its manifest names no weights."""
    parts = ollama_manifest_parts(model)
    folder = models_dir or ollama_models_dir()
    try:
        return _blob_of(parts, folder)
    except OSError as error:  # the Linux service's folder is often readable by the `ollama` group alone
        raise CheckpointError(f"cannot read Ollama's models in {folder} ({error.strerror or error}): join the group "
                              f"that owns it, or copy them and name the copy in ${OLLAMA_MODELS_ENV}") from None


def _blob_of(parts: tuple[str, str, str, str], folder: Path) -> Path:
    registry, namespace, name, tag = parts
    manifest_file = folder / "manifests" / registry / namespace / name / tag
    shown = ollama_short_name(registry, namespace, name, tag)
    if not manifest_file.is_file():
        raise CheckpointError(f"Ollama has not pulled {shown} into {folder} (`ollama pull {shown}` fetches it; "
                              f"${OLLAMA_MODELS_ENV} names another models folder)")
    if manifest_file.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"Ollama's manifest of {shown} ({manifest_file}) is too large to be one")
    try:
        layers = json.loads(manifest_file.read_text(encoding="utf-8")).get("layers")
        kinds = [layer.get("mediaType") for layer in layers]
        digests = [layer.get("digest") for layer in layers if layer.get("mediaType") == OLLAMA_WEIGHTS_MEDIA_TYPE]
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"Ollama's manifest of {shown} ({manifest_file}) is not one hearth reads") from None
    if OLLAMA_ADAPTER_MEDIA_TYPE in kinds:
        raise CheckpointError(f"Ollama's {shown} applies a LoRA adapter to its weights, which hearth does not: "
                              "served without it, it would be another model")
    if len(digests) != 1:
        raise CheckpointError(f"Ollama's manifest of {shown} names {len(digests)} weights layers, not one GGUF blob")
    if not isinstance(digests[0], str) or not (found := _DIGEST.fullmatch(digests[0])):
        raise CheckpointError(f"Ollama's manifest of {shown} ({manifest_file}) names its weights by no SHA-256 digest")
    blob = folder / "blobs" / f"sha256-{found.group(1)}"
    if not blob.is_file():
        raise CheckpointError(f"Ollama's blob of {shown} ({blob}) is missing (`ollama pull {shown}` fetches it again)")
    return blob


def ollama_short_name(registry: str, namespace: str, name: str, tag: str) -> str:
    """The name as Ollama shows it: its default registry and namespace left out."""
    if registry != OLLAMA_DEFAULT_REGISTRY:
        return f"{registry}/{namespace}/{name}:{tag}"
    return f"{name}:{tag}" if namespace == OLLAMA_DEFAULT_NAMESPACE else f"{namespace}/{name}:{tag}"
