"""The options of the commands that hold a model (`hearth shard`, `hearth host`, `hearth bench`, `hearth eval`):
its device, dtype, quantization and threads, and a shard host's identity (typer only)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

DeviceOption = Annotated[
    Optional[str],
    typer.Option("--device", help="auto|cpu|cuda|cuda:N (auto: CUDA when torch sees one; default: "
                 "[research.distributed_inference.host] device).", show_default=False),
]
DtypeOption = Annotated[
    Optional[str],
    typer.Option("--dtype", help="auto|fp32|bf16|fp16 (auto: bf16 on CUDA, fp16 where bf16 is unsupported, fp32 on "
                 "the CPU; default: [research.distributed_inference.host] dtype).", show_default=False),
]


def checked_quantize(value: str | list[str] | None) -> str | list[str] | None:
    """Every command's --quantize check (a list: each scheme): auto, or a label exactly as written on the wire, as
    the configuration and requests take it, of a scheme this version runs (its int4 group size served), else a usage
    error before anything starts."""
    from hearth.protocol.quantization_labels import check_runnable_setting

    for label in value if isinstance(value, list) else [value]:
        if label is not None:
            try:
                check_runnable_setting(label)
            except ValueError as error:
                raise typer.BadParameter(str(error)) from None
    return value


QuantizeOption = Annotated[
    Optional[str],
    typer.Option("--quantize", callback=checked_quantize, show_default=False,
                 help="auto|none|int8|int4|int4/gN: weights held as the checkpoint stores them (auto: a GGUF's "
                      "4-bit layers as int4, 5- to 8-bit ones as int8, any other checkpoint as none), full "
                      "precision, int8 per output channel or int4 in groups of N inputs (32, 64, 128 or 256; int4 "
                      "alone: 32); the CPU, and CUDA (int4 from compute capability 8.0) (default: "
                      "[research.distributed_inference.host] quantize)."),
]

TorchThreadsOption = Annotated[
    Optional[int],
    typer.Option("--torch-threads", min=1, help="torch intra-op threads (default: torch's choice).",
                 show_default=False),
]
BusyThreadsOption = Annotated[
    Optional[int],
    typer.Option("--busy-threads", min=1, show_default=False,
                 help="Intra-op threads per step while this process serves more than one stream (default: all "
                      "of them). Set 1 when several hearth processes share this machine's cores."),
]
# A shard host's identity options (`hearth shard`, `hearth host`).
HostNodeIdOption = Annotated[
    Optional[str], typer.Option("--node-id", help="This host's id (default: the machine's host name).")
]
ModelIdOption = Annotated[
    Optional[str], typer.Option("--model-id", help="Id to advertise (default: folder name or hub id).")
]
