"""What `hearth ollama` lists: every model Ollama has pulled onto this machine (hearth/inference/ollama_models.py
finds them), whether hearth serves it, and the scheme the default (`--quantize auto`) holds it in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .memory import layer_weight_bytes_of
from .ollama_models import OLLAMA_MODEL_PREFIX, ollama_models_dir, ollama_short_name, resolve_ollama_model
from .quantization import AUTO_QUANTIZATION
from .stored_precision import resolved_scheme


@dataclass(frozen=True)
class PulledModel:
    """A model Ollama pulled onto this machine, as hearth sees it."""

    name: str  # as --model takes it: ollama:NAME:TAG
    size_bytes: int
    architecture: str | None
    num_layers: int | None
    # Why hearth cannot serve it (one line), None when it reads the file's architecture and every block type.
    problem: str | None
    # The scheme `--quantize auto` (the default) holds its layers in (hearth/inference/stored_precision.py), on the
    # CPU; None where it is not served.
    default_scheme: str | None = None
    # The bytes its decoder layers take so, as hosts plan with them (hearth/inference/memory.py): what the mesh's
    # hosts must hold between them, besides their KV caches; None where it is not served.
    default_layers_bytes: int | None = None


def pulled_ollama_models(models_dir: Path | None = None) -> list[PulledModel]:
    """Every model whose manifest lies under Ollama's models folder, in name order, each with its weights' GGUF
    described from its header alone (what a shard would refuse at load beyond the architecture and block types,
    such as a RoPE hearth does not read, is not checked here)."""
    from hearth.formats.gguf_support import SUPPORTED_GGUF_ARCHITECTURES

    from .gguf_header import read_gguf_header
    from .gguf_layout import check_block_types
    from .gguf_tensor_table import header_layer_tensors

    folder = models_dir or ollama_models_dir()
    manifests = folder / "manifests"
    try:
        found = sorted(path for path in manifests.glob("*/*/*/*") if path.is_file())
    except OSError as error:
        raise CheckpointError(f"cannot read Ollama's models in {folder} ({error.strerror or error})") from None
    pulled = []
    for manifest in found:
        name = OLLAMA_MODEL_PREFIX + ollama_short_name(*manifest.relative_to(manifests).parts)
        try:
            blob = resolve_ollama_model(name, folder)
            header = read_gguf_header(blob)
            size = blob.stat().st_size
        except (CheckpointError, OSError) as error:
            pulled.append(PulledModel(name, 0, None, None, str(error)))
            continue
        architecture = header.architecture
        layers = header.metadata.get(f"{architecture}.block_count")
        problem = default_scheme = layers_bytes = None
        if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            problem = f"a {architecture!r} model; hearth serves {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        else:
            try:
                check_block_types(((t.name, t.block_type) for t in header.split.tensors), blob.name)
                layer_tensors = header_layer_tensors(header.split.tensors)
                scheme = resolved_scheme(AUTO_QUANTIZATION, layer_tensors, "cpu")
                default_scheme = scheme.label
                layers_bytes = sum(layer_weight_bytes_of(layer_tensors, torch.float32, scheme, device="cpu").values())
            except CheckpointError as error:
                problem = str(error)
        pulled.append(PulledModel(name, size, architecture, layers if isinstance(layers, int) else None, problem,
                                  default_scheme, layers_bytes))
    return sorted(pulled, key=lambda model: model.name)


def listing_line(model: PulledModel, width: int) -> str:
    """`hearth ollama`'s line of `model`: its name padded to `width`, what it is, and whether (and in which scheme by
    default) hearth serves it, or why not."""
    described = (f"{model.architecture}, {model.num_layers} layers, {model.size_bytes / 1e9:.2f} GB; "
                 if model.architecture else "")
    verdict = (f"served, by default in {model.default_scheme} ({_shown_bytes(model.default_layers_bytes or 0)} of "
               "layers)") if model.problem is None else f"not served: {model.problem}"
    return f"{model.name:<{width}}  {described}{verdict}"


def _shown_bytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"
