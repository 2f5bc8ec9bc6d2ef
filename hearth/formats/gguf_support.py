"""Which GGUF files hearth serves: how one is told (its name or magic), the architectures and block types hearth
reads, and the one-line refusals naming what it does not; no torch, so the demo checks a file before it starts
anything (hearth/services/devtools/demo_model.py) in the words a shard would refuse it with
(hearth/inference/gguf_header.py, hearth/inference/gguf_layout.py)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
# general.architecture values hearth serves (llama.cpp writes Mistral models as "llama").
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Storage types hearth reads: plain floats, and the legacy, K-quant and I-quant block types gguf.quants dequantizes
# (its ternary TQ types and the FP4 ones, MXFP4 and NVFP4, are left out: no model hearth serves uses them; integer
# tensors are no weights).
SUPPORTED_GGUF_TYPE_NAMES = (
    "F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
)
# Block types that hold plain floats; every other supported type is a quantized block.
FLOAT_GGUF_TYPE_NAMES = frozenset({"F32", "F16", "BF16", "F64"})
# Tensors of other modalities that Ollama's files hold beside a model's text weights (a vision tower and its
# projector, an audio encoder). hearth serves the text model: no split, part, fetched range, memory figure or block
# type check of a GGUF counts them.
OTHER_MODALITY_PREFIXES = ("v.", "mm.", "a.")


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a GGUF file: named *.gguf, or starting with the GGUF magic (Ollama keeps its models' GGUFs
    as blobs named by their digest)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    try:
        with path.open("rb") as handle:
            return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def is_text_model_tensor(tensor_name: str) -> bool:
    """Whether a GGUF tensor belongs to the text model (not to a bundled vision or audio encoder)."""
    return not tensor_name.startswith(OTHER_MODALITY_PREFIXES)


def unsupported_architecture(architecture: object, file_name: str) -> str | None:
    """The one line refusing the GGUF `file_name` whose general.architecture is `architecture`, None when hearth
    serves it."""
    if architecture in SUPPORTED_GGUF_ARCHITECTURES:
        return None
    return (f"GGUF {file_name} holds a {architecture!r} model; hearth serves "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUFs (Mistral is written as llama)")


def unsupported_block_type(tensors: Iterable[tuple[str, str]], file_name: str) -> str | None:
    """The one line naming the first of `tensors` ((GGUF name, GGML type name)) stored in a block type hearth does
    not read, None when it reads them all."""
    for name, block_type in tensors:
        if block_type not in SUPPORTED_GGUF_TYPE_NAMES:
            return (f"tensor {name} of {file_name} is stored as {block_type}, a GGUF type hearth does not read (it "
                    f"reads {', '.join(SUPPORTED_GGUF_TYPE_NAMES)})")
    return None
