"""A GGUF's 4-bit block types (Q4_0, Q4_1, Q4_K) read as what they are: 4-bit codes in groups of 32 input features,
each group with its own scale and minimum, the form torch's int4 kernels serve (hearth/inference/quantization.py).

Q4_0 and Q4_1 blocks are one group of 32 (Q4_0: ``d * (q - 8)``, Q4_1: ``d * q + m``); a Q4_K super-block of 256
holds eight sub-blocks of 32, each with its own 6-bit scale and minimum (``d * sc * q - dmin * m``). The values
``codes * scales + minimums`` are exactly those the gguf package's dequantizers give.
"""

from __future__ import annotations

import numpy as np

# The GGUF block types whose codes are 4 bits in groups of this many input features.
STORED_INT4_GROUP_SIZES: dict[str, int] = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32}
_Q4_0_OFFSET = 8
_NIBBLE = np.uint8(0x0F)
_K_SCALE_BYTES = 12


def int4_groups_of_blocks(blocks: np.ndarray, block_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [n, values per block], scales float32 [n, groups per block], minimums likewise) of `blocks`
    ([n, bytes per block] uint8) of `block_type`, one of STORED_INT4_GROUP_SIZES."""
    if block_type == "Q4_0":
        scales = _float16_field(blocks, 0)
        return _low_then_high_nibbles(blocks[:, 2:]), scales, scales * -_Q4_0_OFFSET
    if block_type == "Q4_1":
        return _low_then_high_nibbles(blocks[:, 4:]), _float16_field(blocks, 0), _float16_field(blocks, 2)
    if block_type == "Q4_K":
        from gguf.quants import Q4_K

        d, dmin = _float16_field(blocks, 0), _float16_field(blocks, 2)
        sub_scales, sub_minimums = Q4_K.get_scale_min(blocks[:, 4:4 + _K_SCALE_BYTES].copy())
        # Each run of 32 bytes holds two sub-blocks: the low nibbles, then the high ones.
        packed = blocks[:, 4 + _K_SCALE_BYTES:].reshape(len(blocks), -1, 32)
        codes = np.concatenate([packed & _NIBBLE, packed >> 4], axis=2).reshape(len(blocks), -1)
        return codes, d * sub_scales.astype(np.float32), -(dmin * sub_minimums.astype(np.float32))
    raise ValueError(f"{block_type} is not a 4-bit block type of groups ({', '.join(STORED_INT4_GROUP_SIZES)})")


def _float16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 each block holds at byte `offset`, as float32 [n, 1]."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _low_then_high_nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 order: a block's 16 bytes hold values 0..15 in their low nibbles and 16..31 in their high ones."""
    return np.concatenate([packed & _NIBBLE, packed >> 4], axis=1)
