"""Quantized shard weights: the schemes a layer range may serve ("none", "int8", "int4/g<group>"), their parsing and
labels, and the in-place swap of a decoder layer's nn.Linear modules for QuantizedLinear running PyTorch's own
int8 and int4 kernels.

Kernels (chosen by measurement, BENCHMARKS.md "Quantized shard kernels"):
- int8: weights int8 per output channel (symmetric, one scale per row); on fbgemm's int8 product with each
  activation row quantized on its own scale (hearth/inference/int8_kernels.py), else torch's weight-only
  ``torch._weight_int8pack_mm``;
- int4: weights uint4 in groups of ``group_size`` input features (asymmetric: a scale and a zero per group),
  packed by ``torch._convert_weight_to_int4pack_for_cpu`` and multiplied by ``torch._weight_int4pack_mm_for_cpu``.
The weight-only kernels take bfloat16 activations (their float32 paths are an order of magnitude slower on the
CPU): a float32 layer's inputs are rounded to bfloat16 for the product and its results widened back. Every row of a
product is computed on its own whatever the batch, so a range split over hops gives the very logits of one whole
range, and batched steps (and the head's batched logits) equal one-row ones bit for bit.

What each weight of a GGUF is held in, given how it is stored (its 4-bit groups as they are, a 4-bit mix's more
precise matrices in int8), is hearth/inference/held_forms.py's.

On CUDA the same codes run on torch's CUDA kernels: int4 on ``torch._weight_int4pack_mm`` (tinygemm, packed by
``torch._convert_weight_to_int4pack``; compute capability 8.0 or newer); int8 on ``torch._int_mm`` (cuBLASLt's int8
product, exact in int32) with each activation row quantized to int8 on its own scale; faster there than torch's
weight-only ``_weight_int8pack_mm`` or weights widened per call, but slower than bf16 weights: on a GPU int8 saves
memory, int4 saves memory and time (BENCHMARKS.md "Quantized shards on a GPU"). Other devices are refused with a
QuantizationError.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .errors import InferenceError
from .heap import release_freed_heap
from .int8_kernels import INT_MM_FEATURE_MULTIPLE, cuda_row_product, fbgemm_row_product, fbgemm_shared_product, \
    int8_rows_on_cpu, pack_for_fbgemm
from .shared_products import SharedRowProduct
from .weight_codes import KERNEL_DTYPE, Int4Codes, Int4Groups, int4_codes, int4_grouped_codes, int8_per_channel, \
    pack_int4_for_cuda, row_chunks

DEFAULT_QUANTIZATION = "none"
# The setting that serves each checkpoint as it is stored (hearth/inference/stored_precision.py); mirrored by
# hearth/protocol/quantization_labels.py, which the configuration and the CLI check against without torch.
AUTO_QUANTIZATION = "auto"
# Faithful to the 4-bit GGUF blocks (Q4_0, Q4_1: groups of 32) and measured best on their models (BENCHMARKS.md
# "Quantized shards: quality").
DEFAULT_INT4_GROUP_SIZE = 32
# Mirrored by hearth/protocol/quantization_labels.py (which the CLI and configuration check against, without torch).
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
QUANTIZATION_KINDS: tuple[str, ...] = ("none", "int8", "int4")  # most precise first
_INT4_PACK_MIN_ROWS = 16
_SCHEME_RE = re.compile(r"^(none|int8|int4)(?:/g(\d+))?$")


class QuantizationError(InferenceError):
    """A quantization scheme that is malformed, or that this device or layer has no kernel for."""


@dataclass(frozen=True)
class QuantizationScheme:
    """How a shard's Linear weights are held: ``kind`` "none", "int8" or "int4"; ``group_size`` for int4 only."""

    kind: str = "none"
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in QUANTIZATION_KINDS:
            raise QuantizationError(
                f"quantization kind {self.kind!r} is not one of {', '.join(QUANTIZATION_KINDS)}")
        if self.kind == "int4":
            if self.group_size not in INT4_GROUP_SIZES:
                raise QuantizationError(
                    f"int4 group size {self.group_size} is not one of {', '.join(map(str, INT4_GROUP_SIZES))}")
        elif self.group_size is not None:
            raise QuantizationError(f"quantization {self.kind} takes no group size")

    @property
    def label(self) -> str:
        """The canonical name used on every wire: "none", "int8", "int4/g64"."""
        return f"int4/g{self.group_size}" if self.kind == "int4" else self.kind

    @property
    def quantized(self) -> bool:
        return self.kind != "none"

    def __str__(self) -> str:
        return self.label


# What a quantized model's lm_head is held in, whatever the layers' scheme (load_head says why).
HEAD_QUANTIZATION = QuantizationScheme("int8")


def parse_quantization(text: str | QuantizationScheme | None) -> QuantizationScheme:
    """The scheme named by ``text`` ("none", "int8", "int4" (default group), "int4/g32", ...); None means "none"."""
    if isinstance(text, QuantizationScheme):
        return text
    if text is None:
        return QuantizationScheme()
    if not isinstance(text, str):
        raise QuantizationError(f"quantization must be a string such as 'int8', not {type(text).__name__}")
    match = _SCHEME_RE.fullmatch(text)  # exact, as labels travel on the wire
    if match is None:
        raise QuantizationError(
            f"unknown quantization {text!r}: expected none, int8, int4 or int4/g<group size> "
            f"(group sizes {', '.join(map(str, INT4_GROUP_SIZES))})")
    kind, group = match.group(1), match.group(2)
    if kind == "int4":
        return QuantizationScheme("int4", int(group) if group else DEFAULT_INT4_GROUP_SIZE)
    if group:
        raise QuantizationError(f"unknown quantization {text!r}: only int4 takes a group size")
    return QuantizationScheme(kind)


# tinygemm, torch's CUDA int4 kernel, runs on Ampere (compute capability 8.0) and newer.
INT4_CUDA_MIN_CAPABILITY = (8, 0)


def check_device_supports(scheme: QuantizationScheme, device: torch.device | str) -> None:
    """Raise QuantizationError unless this build has a wired kernel for ``scheme`` on ``device``."""
    device = torch.device(device)
    if not scheme.quantized or device.type == "cpu":
        return
    if device.type != "cuda":
        raise QuantizationError(
            f"quantization {scheme.label} has no kernel on {device.type} in hearth (CPU and CUDA only); "
            "serve this device with quantization none")
    if scheme.kind == "int4" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < INT4_CUDA_MIN_CAPABILITY:
            raise QuantizationError(
                f"quantization {scheme.label} needs a CUDA GPU of compute capability "
                f"{'.'.join(map(str, INT4_CUDA_MIN_CAPABILITY))} or newer (torch's int4 kernel), this one is "
                f"{'.'.join(map(str, capability))}; use int8")


def head_quantization(device: torch.device | str) -> QuantizationScheme | None:
    """What a quantized model's lm_head is held in on ``device``: int8 (HEAD_QUANTIZATION) on the CPU; on CUDA full
    precision (None), where no int8 product is faster than bf16 weights (the module docstring says why)."""
    return None if torch.device(device).type == "cuda" else HEAD_QUANTIZATION


# ----------------------------------------------------------------------------------------------- memory figures

def held_tensor_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes the weights of ``modules`` hold: parameters and buffers (a tensor shared by two modules counts once),
    and int8 codes packed outside the buffers (QuantizedLinear.packed_bytes)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        total += sum(child.packed_bytes for child in module.modules() if isinstance(child, QuantizedLinear))
    return total


# ----------------------------------------------------------------------------------------------- the module

class QuantizedLinear(nn.Module):
    """A Linear whose weight is held quantized (in buffers, or int8 codes in fbgemm's packed form: packed_bytes) and
    whose product runs on the module docstring's kernels; the bias, if any, stays dense. With ``stored`` (int4 codes
    in ``scheme``'s groups: as the checkpoint stores them, or as rounded before, hearth/inference/int4_code_cache.py)
    the codes are taken as they are and ``dense`` gives only its shape and bias (its weight may be on the meta
    device). With ``weight_rows`` (int8 on the CPU: the weight's
    rows in order, as a checkpoint reads them a chunk at a time) ``dense`` gives only its shape and bias likewise, so
    the weight is never held whole in floats; its codes are the loaded weight's, each row having its own scale."""

    def __init__(self, dense: nn.Linear, scheme: QuantizationScheme, stored: Int4Groups | Int4Codes | None = None,
                 weight_rows: Iterable[torch.Tensor] | None = None, *, pack: bool = True) -> None:
        super().__init__()
        if not scheme.quantized:
            raise QuantizationError("QuantizedLinear needs a quantized scheme, not none")
        if weight_rows is not None and (scheme.kind != "int8" or stored is not None):
            raise QuantizationError(f"a Linear's weight given by rows is held in int8 only, not {scheme.label}")
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.scheme = scheme
        rows, columns = self.out_features, self.in_features
        if stored is not None and (scheme.kind != "int4" or stored.group_size != scheme.group_size
                                   or stored.shape != (rows, columns)):
            raise QuantizationError(
                f"stored int4 codes {stored.shape} in groups of {stored.group_size} cannot be held as "
                f"{scheme.label} for a {rows}x{columns} Linear")
        weight = None if stored is not None or weight_rows is not None else dense.weight.detach()
        device = (stored.device if stored is not None
                  else torch.device("cpu") if weight is None else weight.device)
        # torch._int_mm needs feature counts that are multiples of 8; others keep torch's weight-only kernel.
        self._int8_dynamic = (device.type == "cuda" and scheme.kind == "int8"
                              and columns % INT_MM_FEATURE_MULTIPLE == 0 and rows % INT_MM_FEATURE_MULTIPLE == 0)
        self._fbgemm_packed = None
        self._codes_to_pack: torch.Tensor | None = None  # int8 codes for fbgemm, left unpacked (pack=False)
        self._shared: tuple[SharedRowProduct, int] | None = None
        with torch.no_grad():
            if scheme.kind == "int8":
                codes = torch.empty(rows, columns, dtype=torch.int8, device=device)
                scales = torch.empty(rows, dtype=KERNEL_DTYPE, device=device)
                for first, last, chunk in _weight_rows(weight, weight_rows, self.out_features):
                    codes[first:last], scales[first:last] = int8_per_channel(chunk.float())
                if device.type == "cpu" and int8_rows_on_cpu():  # the codes live in the packed form only
                    self._codes_to_pack = codes
                else:
                    self.register_buffer("weight_int8", codes)
                self.register_buffer("scales", scales)
                if pack:
                    self.pack_codes()
            elif device.type == "cuda":
                codes, scales_and_zeros = (stored.kernel_form(0, rows) if stored is not None
                                           else int4_grouped_codes(weight.float(), scheme.group_size))
                self.register_buffer("weight_int4pack", pack_int4_for_cuda(codes))
                self.register_buffer("scales_and_zeros", scales_and_zeros)
            else:
                if not isinstance(stored, Int4Codes):
                    stored = (int4_codes(weight, scheme.group_size) if stored is None
                              else stored.packed_for_cpu())
                self.register_buffer("weight_int4pack", stored.packed_codes)
                self.register_buffer("scales_and_zeros", stored.scales_and_zeros)
        bias = dense.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        leading = inputs.shape[:-1]
        if self._shared is not None:
            shared, member = self._shared
            product = shared.columns(member, inputs.reshape(-1, self.in_features))
        elif self._fbgemm_packed is not None:
            rows = inputs.reshape(-1, self.in_features)
            product = fbgemm_row_product(rows, self._fbgemm_packed)
        else:
            rows = inputs.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
            product = self._weight_product(rows)
        product = product.to(inputs.dtype).reshape(*leading, self.out_features)
        return product if self.bias is None else product + self.bias

    def pack_codes(self) -> None:
        """Pack for fbgemm, alone, the int8 codes left unpacked (``pack=False``: quantize_linears packs a layer's,
        those of Linears reading one input as one product)."""
        if self._codes_to_pack is not None:
            self._fbgemm_packed = pack_for_fbgemm(self._codes_to_pack, self.scales.float())
            self._codes_to_pack = None

    def _weight_product(self, rows: torch.Tensor) -> torch.Tensor:
        if self._codes_to_pack is not None:
            raise QuantizationError("a QuantizedLinear's int8 codes were left unpacked (pack=False) and never packed")
        if self._int8_dynamic:
            return cuda_row_product(rows, self.weight_int8, self.scales).to(KERNEL_DTYPE)
        if self.scheme.kind == "int8":
            return torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if rows.is_cuda:
            return torch._weight_int4pack_mm(rows, self.weight_int4pack, self.scheme.group_size, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(rows, self.weight_int4pack, self.scheme.group_size,
                                                 self.scales_and_zeros)

    @property
    def shared(self) -> tuple[SharedRowProduct, int] | None:
        """The product this Linear shares with others reading its input, and its member index there; None if own."""
        return self._shared

    @property
    def packed_bytes(self) -> int:
        """Bytes of the weight held outside the module's buffers (the int8 codes in fbgemm's packed form, its own or
        its part of a shared one)."""
        packed = self._fbgemm_packed is not None or self._shared is not None or self._codes_to_pack is not None
        return self.out_features * self.in_features if packed else 0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.label}"


def _weight_rows(weight: torch.Tensor | None, given: Iterable[torch.Tensor] | None,
                 count: int) -> Iterable[tuple[int, int, torch.Tensor]]:
    """(first, last, rows) of a weight's `count` rows: `given` chunks in order, else `weight`'s in _row_chunks."""
    if given is None:
        yield from ((first, last, weight[first:last]) for first, last in row_chunks(count))
        return
    first = 0
    for chunk in given:
        last = first + chunk.shape[0]
        if last > count:
            raise QuantizationError(f"the weight's rows came to more than its {count}")
        yield first, last, chunk
        first = last
    if first != count:
        raise QuantizationError(f"the weight's rows came to {first}, not {count}")


# ----------------------------------------------------------------------------------------------- layers

def dense_linears(module: nn.Module) -> Iterable[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, Linear) of every plain nn.Linear of ``module``."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                yield parent, name, child


def check_quantizable(layer: nn.Module, scheme: QuantizationScheme, what: str,
                      held_otherwise: Collection[nn.Module] = ()) -> None:
    """Raise QuantizationError when a Linear of ``layer`` (a meta skeleton is enough) but those in
    ``held_otherwise`` (held in another form, which fits them: hearth/inference/held_forms.py) cannot take
    ``scheme``: int4 needs its input features to be a multiple of the group size and its output features of 16
    (torch's packing)."""
    if scheme.kind != "int4":
        return
    for parent, name, linear in dense_linears(layer):
        if linear in held_otherwise:
            continue
        if problem := int4_shape_problem(linear.out_features, linear.in_features, scheme):
            raise QuantizationError(f"{what}: {name} has {problem}")


def int4_shape_problem(out_features: int, in_features: int, scheme: QuantizationScheme) -> str | None:
    """Why torch's int4 kernel cannot hold a Linear of that shape under ``scheme`` (its packing), None if it can."""
    if in_features % scheme.group_size:
        return (f"{in_features} input features, not a multiple of {scheme.label}'s group size {scheme.group_size}; "
                "choose a smaller group size or int8")
    if out_features % _INT4_PACK_MIN_ROWS:
        return (f"{out_features} output features, not a multiple of {_INT4_PACK_MIN_ROWS} as torch's int4 kernel "
                "needs; use int8")
    return None


def quantize_linears(layer: nn.Module, scheme: QuantizationScheme) -> int:
    """Replace every nn.Linear of ``layer`` in place by a QuantizedLinear under ``scheme``, pack the int8 codes of
    its Linears for fbgemm (those already quantized with ``pack=False`` too: pack_int8_products) and copy its other
    tensors (norms) out of any memory map, so nothing of the checkpoint's dense weights stays referenced; returns
    how many Linears were replaced (0 for "none", which leaves the layer untouched)."""
    if not scheme.quantized:
        return 0
    replaced = 0
    for parent, name, linear in dense_linears(layer):
        setattr(parent, name, QuantizedLinear(linear, scheme, pack=False))
        replaced += 1
    pack_int8_products(layer)
    with torch.no_grad():
        for module in layer.modules():
            for name, parameter in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(parameter.detach().clone(), requires_grad=False))
    release_freed_heap()
    return replaced


# Linears of one module that read the same input in the supported architectures (Phi-3 fuses them itself).
SHARED_INPUT_LINEARS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def pack_int8_products(layer: nn.Module) -> None:
    """Pack for fbgemm the int8 codes ``layer``'s QuantizedLinears left unpacked: each SHARED_INPUT_LINEARS group's
    once, as one product its members share (none packed alone first), every other's alone."""
    for parent in layer.modules():
        for names in SHARED_INPUT_LINEARS:
            members = [getattr(parent, name, None) for name in names]
            if all(isinstance(member, QuantizedLinear) and member._codes_to_pack is not None for member in members) \
                    and len({member.in_features for member in members}) == 1:
                codes = torch.cat([member._codes_to_pack for member in members])
                for member in members:  # only the joined codes are held from here
                    member._codes_to_pack = None
                shared = fbgemm_shared_product(codes, torch.cat([member.scales.float() for member in members]),
                                               [member.out_features for member in members])
                for index, member in enumerate(members):  # the shared product holds the codes from now on
                    member._shared = (shared, index)
    for module in layer.modules():
        if isinstance(module, QuantizedLinear):
            module.pack_codes()
