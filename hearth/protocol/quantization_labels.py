"""The wire forms of a weight quantization scheme's label ("none", "int8", "int4", "int4/g64"), which schemes a
requested label accepts, and which of two schemes is the more precise; torch-free, for routing and validation.

hearth/inference/quantization.py parses the same forms into a scheme a device can run (parse_quantization); this
module only reads labels, so a request or an advertisement can be judged without loading torch.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

# What parse_quantization accepts: none, int8, int4 (its default group size) or int4/gN.
_LABEL_FORMS = r"none|int8|int4(/g[1-9][0-9]{0,4})?"
QUANTIZATION_LABEL_PATTERN = rf"^({_LABEL_FORMS})$"
_label_re = re.compile(QUANTIZATION_LABEL_PATTERN)
# The int4 group sizes hearth's kernels serve: hearth/inference/quantization.py's, mirrored (the import rules keep
# torch's side out of here; tests check them equal). A label on the wire may name another (a request routes to
# whatever shards advertise it); a scheme to run here may not (check_runnable_label).
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
# Most precise first: full precision, then 8-bit, then 4-bit weights.
_KIND_ORDER = ("none", "int8", "int4")


# Why a text is no scheme, in every message that says so (a command's --quantize, a request's quantization).
QUANTIZATION_LABEL_EXPECTED = "expected none, int8, int4 or int4/gN (N: a group size)"


def is_quantization_label(text: str) -> bool:
    return bool(_label_re.fullmatch(text))  # fullmatch: "$" alone lets a trailing newline through


def check_quantization_label(text: str) -> str:
    """`text` when it is a scheme's label as written on the wire (exactly: no case folding, no trimming), else
    ValueError naming it and the forms expected."""
    if not isinstance(text, str) or not is_quantization_label(text):
        raise ValueError(f"{text!r} names no scheme: {QUANTIZATION_LABEL_EXPECTED}")
    return text


def check_runnable_label(text: str) -> str:
    """`text` when it is a scheme's label (check_quantization_label) that this version has kernels for: an int4
    group size of INT4_GROUP_SIZES; else ValueError naming it, in one line."""
    check_quantization_label(text)
    _, _, group = text.partition("/g")
    if group and int(group) not in INT4_GROUP_SIZES:
        raise ValueError(f"{text!r} names no scheme hearth runs: int4 group size {group} is not one of "
                         f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    return text


# A machine's setting (`--quantize`, [research.distributed_inference.host] quantize), never a label on the wire:
# each checkpoint served in the precision it is stored in (hearth/inference/stored_precision.py), resolved to a
# label where the checkpoint is read. hearth/inference/quantization.py's, mirrored (tests check them equal).
AUTO_QUANTIZATION = "auto"
QUANTIZE_SETTING_PATTERN = rf"^({AUTO_QUANTIZATION}|{_LABEL_FORMS})$"


def check_runnable_setting(text: str) -> str:
    """`text` when it is AUTO_QUANTIZATION or a label this version runs (check_runnable_label), else ValueError
    naming it, in one line."""
    if text == AUTO_QUANTIZATION:
        return text
    try:
        return check_runnable_label(text)
    except ValueError as error:
        raise ValueError(str(error).replace(QUANTIZATION_LABEL_EXPECTED, "expected auto, none, int8, int4 or "
                                                                         "int4/gN (N: a group size)")) from None


def _checked_field(text: str) -> str:
    try:
        return check_quantization_label(text)
    except ValueError:  # pydantic's own message would be the pattern's regex
        raise PydanticCustomError("quantization_label", "{label} names no scheme: " + QUANTIZATION_LABEL_EXPECTED,
                                  {"label": repr(text)}) from None


# A model field holding a scheme's label (a request's, the gateway's option): refused in the words `hearth chat
# --quantization` uses; its JSON schema keeps the pattern.
QuantizationLabel = Annotated[str, AfterValidator(_checked_field),
                              Field(json_schema_extra={"pattern": QUANTIZATION_LABEL_PATTERN})]


def accepts(requested: str | None, served: str) -> bool:
    """Whether a shard serving `served` may run a request that asked for `requested` (None: any scheme); a bare
    "int4" accepts every int4 group size, "int4/g32" only that one."""
    if requested is None:
        return True
    return served == requested or ("/" not in requested and served.split("/", 1)[0] == requested)


def precision_order(label: str) -> tuple[int, int, str]:
    """A sort key, most precise scheme first: none, int8, int4 by ascending group size, then labels this version
    does not know."""
    kind, _, group = label.partition("/")
    rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
    group_size = int(group[1:]) if group.startswith("g") and group[1:].isdigit() else 0
    return rank, group_size, label
