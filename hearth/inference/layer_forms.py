"""The forms a decoder layer's Linears load in besides a dense weight rounded to the scheme (held otherwise than the
scheme rounds them, or int4 rounded on the CPU), and a Linear's weight read from the checkpoint's rows a chunk at a
time for rounding, so a quantized load never holds a layer in floats (hearth/inference/loading.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .errors import CheckpointError
from .int4_code_cache import Int4CodeCache
from .quantization import QuantizationScheme
from .weight_codes import rows_per_chunk


@dataclass(frozen=True)
class HeldOtherwise:
    """A layer's Linear that a rule of hearth/inference/held_forms.py holds in `held` rather than as the scheme
    asked rounds it: where it sits (its parent's attribute), and its checkpoint weight's name."""

    parent: nn.Module
    child_name: str
    linear: nn.Linear
    weight_name: str
    held: QuantizationScheme


@dataclass(frozen=True)
class RoundedOnCPU:
    """A layer's Linear whose float weight int4 rounds on the CPU, and the cache of its codes (None: none)."""

    parent: nn.Module
    child_name: str
    linear: nn.Linear
    weight_name: str
    cache: Int4CodeCache | None


def check_tensor_form(name: str, shape: Sequence[int], dtype: torch.dtype, expected: torch.Tensor) -> None:
    """CheckpointError where the checkpoint's tensor `name` (`shape`, `dtype` as read) is not what the model's
    config makes it (`expected`, the skeleton's tensor): another shape, or integers where it has floats."""
    if tuple(shape) != tuple(expected.shape):
        raise CheckpointError(f"the checkpoint's {name} is {tuple(shape)}, where the model's config makes it "
                              f"{tuple(expected.shape)}")
    if dtype.is_floating_point != expected.is_floating_point():  # torch would refuse the copy
        raise CheckpointError(f"the checkpoint's {name} is stored as {dtype}, where the model's config makes it "
                              f"{expected.dtype}")


def weight_rows(checkpoint, linear: nn.Linear, weight_name: str, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The Linear's weight from `checkpoint` (checked against the Linear first), weight_codes.rows_per_chunk rows
    at a time, in `dtype` as ``read`` gives it: what is rounded from them is what the whole weight would round to."""
    shape, stored_dtype = checkpoint.stored_form(weight_name)
    check_tensor_form(weight_name, shape, stored_dtype, linear.weight)
    return (torch.from_numpy(chunk).to(dtype)
            for chunk in checkpoint.row_chunks(weight_name, rows_per_chunk(linear.out_features)))
