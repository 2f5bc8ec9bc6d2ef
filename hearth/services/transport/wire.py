"""Wire dtypes and the tensor <-> raw payload bytes codec of docs/protocol.md, including blockwise int8.

A step's wire bytes are the tensor's raw little-endian memory in its wire dtype (no JSON, no base64):
``float32``, ``bfloat16``, ``float16`` or ``int8``. The default wire dtype is the tensor's own dtype,
which is lossless. ``float16`` on the wire saturates values beyond ±65504 (instead of producing inf,
which would look like corruption downstream).

Blockwise int8 (``Hearth-Dtype: int8``): the tensor is flattened to ``numel`` elements and cut into
``nb = ceil(numel / block)`` blocks of ``block`` consecutive elements (the last block may be short).
The step's wire bytes are ``scales: float32[nb]`` followed by ``q: int8[numel]``, where
``scale[b] = max|x| over block b / 127`` and ``q = round(x / scale[b])`` clamped to [-127, 127]
(an all-zero block has scale 0 and q 0). The receiver restores ``x ≈ q * scale[b]``; the error of
each element is at most ``scale[b] / 2``. Non-finite inputs are not representable in int8.
"""

from __future__ import annotations

import enum
import math
import sys

import torch

from hearth.services.common.config import MiB, TransportSettings

if sys.byteorder != "little":  # the wire is little-endian raw memory; a big-endian host would need swaps
    raise ImportError("hearth.services.transport supports little-endian hosts only")

_defaults = TransportSettings()

max_tensor_dims = 8
# What the dimensions of a tensor's shape may multiply to, an empty one counted as one: torch computes strides in
# signed 64-bit integers, so an empty tensor of dimensions past it cannot even be made (a frame declaring one is
# refused).
max_shape_extent = 2**63 - 1
# Converting a tensor of at least this many bytes (a dtype cast, int8 quantisation or dequantisation) runs in a
# worker thread, so a prefill-sized step never stalls the event loop; smaller ones are cheaper inline.
conversion_offload_bytes = MiB
fp16_max_abs = 65504.0
int8_max_abs = 127


class WireDtype(str, enum.Enum):
    """How tensor elements are laid out on the wire (and, minus int8, which dtypes a hop computes in)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    int8 = "int8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @classmethod
    def of(cls, dtype: torch.dtype) -> "WireDtype":
        """The wire name of a compute dtype; float32, bfloat16 and float16 are supported."""
        for wire, torch_dtype in _TORCH_DTYPES.items():
            if torch_dtype == dtype and wire is not cls.int8:
                return wire
        raise ValueError(f"activation dtype {dtype} is not supported (float32, bfloat16 or float16)")


_TORCH_DTYPES: dict[WireDtype, torch.dtype] = {
    WireDtype.float32: torch.float32,
    WireDtype.bfloat16: torch.bfloat16,
    WireDtype.float16: torch.float16,
    WireDtype.int8: torch.int8,
}
_ELEMENT_BYTES = {WireDtype.float32: 4, WireDtype.bfloat16: 2, WireDtype.float16: 2}
_SETTING_ALIASES = {
    "auto": None,
    "fp32": WireDtype.float32,
    "float32": WireDtype.float32,
    "fp16": WireDtype.float16,
    "float16": WireDtype.float16,
    "bf16": WireDtype.bfloat16,
    "bfloat16": WireDtype.bfloat16,
    "int8": WireDtype.int8,
}

# Dtypes whose CPU tensors .numpy() can view without a copy.
numpy_viewable_dtypes = (torch.float32, torch.float16, torch.uint8, torch.int8)


def wire_dtype_from_setting(setting: str) -> WireDtype | None:
    """Map the `activation_dtype` setting (auto | fp16 | fp32 | bf16 | int8) to a wire dtype; auto -> None."""
    try:
        return _SETTING_ALIASES[setting.strip().lower()]
    except KeyError:
        raise ValueError(
            f"activation_dtype {setting!r} is not one of {', '.join(sorted(_SETTING_ALIASES))}"
        ) from None


def int8_block_count(numel: int, block_elems: int) -> int:
    return -(-numel // block_elems)


def wire_nbytes(dtype: WireDtype, shape: tuple[int, ...], int8_block: int | None = None) -> int:
    """Size of a whole step's payload for this wire dtype and shape."""
    numel = math.prod(shape)
    if dtype is WireDtype.int8:
        if not int8_block:
            raise ValueError("int8 wire dtype needs a block size")
        return 4 * int8_block_count(numel, int8_block) + numel
    return _ELEMENT_BYTES[dtype] * numel


def quantize_int8_blockwise(tensor: torch.Tensor, block_elems: int = _defaults.int8_block_elems) -> torch.Tensor:
    """The int8 wire bytes of a tensor (float32 scales then int8 values, see module docstring), as uint8."""
    if block_elems < 1:
        raise ValueError(f"int8 block size must be positive, got {block_elems}")
    flat = tensor.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    blocks = int8_block_count(numel, block_elems)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_elems - numel)).view(blocks, block_elems)
    scales = padded.abs().amax(dim=1) / int8_max_abs
    safe_scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(padded / safe_scales[:, None]).clamp_(-int8_max_abs, int8_max_abs).to(torch.int8)
    return torch.cat((scales.view(torch.uint8), quantized.reshape(-1)[:numel].view(torch.uint8)))


def dequantize_int8_blockwise(
    payload: torch.Tensor, shape: tuple[int, ...], block_elems: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of quantize_int8_blockwise: a tensor of `shape` and `dtype` from the uint8 wire bytes."""
    numel = math.prod(shape)
    blocks = int8_block_count(numel, block_elems)
    scales = payload[: 4 * blocks].view(torch.float32)
    quantized = payload[4 * blocks : 4 * blocks + numel].view(torch.int8).to(torch.float32)
    # Whole blocks as rows, the last partial one on its own: no padding, so memory follows the frame's elements
    # whatever block size it declares.
    whole = numel // block_elems
    values = (quantized[: whole * block_elems].view(whole, block_elems) * scales[:whole, None]).reshape(-1)
    if whole < blocks:
        values = torch.cat((values, quantized[whole * block_elems:] * scales[whole]))
    return values.view(shape).to(dtype)


def encode_payload(
    tensor: torch.Tensor, wire_dtype: WireDtype | None, int8_block: int
) -> tuple[WireDtype, WireDtype, int | None, torch.Tensor, memoryview]:
    """A tensor's wire bytes: (wire dtype, compute dtype, int8 block or None, the tensor owning the bytes,
    a flat byte view of them); zero-copy when the wire dtype is the tensor's own and it is contiguous on CPU."""
    if tensor.dim() < 1 or tensor.dim() > max_tensor_dims:
        raise ValueError(f"activation tensors need 1..{max_tensor_dims} dimensions, got shape {tuple(tensor.shape)}")
    compute = WireDtype.of(tensor.dtype)
    wire = wire_dtype or compute
    source = tensor.detach() if tensor.requires_grad else tensor
    if source.device.type != "cpu":
        source = source.cpu()
    block: int | None = None
    if wire is WireDtype.int8:
        block = int8_block
        payload = quantize_int8_blockwise(source, int8_block)
    else:
        if wire is WireDtype.float16 and compute is not WireDtype.float16:
            source = source.clamp(-fp16_max_abs, fp16_max_abs)
        payload = source.to(wire.torch_dtype) if wire is not compute else source
        payload = payload if payload.is_contiguous() else payload.contiguous()
    if payload.numel() == 0:
        view = memoryview(b"")
    elif payload.dtype in numpy_viewable_dtypes:
        # The cheap way to the bytes: no torch dispatch besides contiguous() (this runs once per step on every
        # hop right after its layers evicted the caches, where each torch call is slow).
        view = memoryview(payload.numpy()).cast("B")
    else:  # bfloat16 has no numpy dtype: reinterpret as bytes first
        view = memoryview(payload.reshape(-1).view(torch.uint8).numpy())
    return wire, compute, block, payload, view


def decode_payload(
    wire: WireDtype, restored: WireDtype, shape: tuple[int, ...], int8_block: int | None, buffer: bytearray
) -> torch.Tensor:
    """The tensor a step's complete wire bytes describe, in the `restored` dtype; shares `buffer` when it can."""
    restored_dtype = restored.torch_dtype
    if not buffer:
        return torch.empty(shape, dtype=restored_dtype)
    if wire is WireDtype.int8:
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
        return dequantize_int8_blockwise(raw, shape, int8_block or 1, restored_dtype)
    tensor = torch.frombuffer(buffer, dtype=wire.torch_dtype).view(shape)
    return tensor if tensor.dtype == restored_dtype else tensor.to(restored_dtype)
