"""Times the per-step transport and integrity code warm and with cold caches (as a hop runs it after its layers).

A hop runs its framing code once per decode step, right after its layers streamed hundreds of MB of weights
through the caches; this times each piece back to back ("warm") and after streaming a large buffer through
the caches first ("cold"):

    .venv/bin/python scripts/bench_cold_paths.py --evict-mb 700
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hearth.services.transport.frames import FrameHeader, FrameKind, StepAssembler, StepInfo, encode_step
from hearth.services.transport.integrity import NormBounds


def median_us(function, evict: torch.Tensor | None, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.add_(1.0)
        started = time.perf_counter()
        function()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the 1x1xH decode step")
    parser.add_argument("--evict-mb", type=int, default=700, help="MB streamed through the caches before a cold run")
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    evict = torch.empty(args.evict_mb * 2**20 // 4)
    hidden = torch.randn(1, 1, args.hidden)
    info = StepInfo(session="abcdef0123456789", step=5, kind=FrameKind.decode, pos=70)
    encoded = encode_step(info, hidden)
    headers = encoded.header("p" * 16, 1, 0, sent_ns=time.time_ns()).to_nats_headers()
    payload = bytes(encoded.chunks[0])
    parsed = FrameHeader.from_nats_headers(headers)
    bounds = NormBounds()
    bounds.check(hidden)

    def restore() -> torch.Tensor | None:
        assembler = StepAssembler(parsed)
        assembler.add(parsed, payload)
        return assembler.tensor()

    pieces = {
        "encode_step (tensor -> chunk views)": lambda: encode_step(info, hidden),
        "frame header -> NATS headers": lambda: encoded.header("p" * 16, 1, 0).to_nats_headers(),
        "NATS headers -> FrameHeader (validated)": lambda: FrameHeader.from_nats_headers(headers),
        "assemble + restore the tensor": restore,
        "NormBounds.check": lambda: bounds.check(hidden),
    }
    print(f"| piece (1x1x{args.hidden} fp32) | warm | cold (after {args.evict_mb} MB streamed) |")
    print("|---|---:|---:|")
    for name, function in pieces.items():
        warm = median_us(function, None, args.repeats)
        cold = median_us(function, evict, args.repeats)
        print(f"| {name} | {warm:.1f} us | {cold:.1f} us |")


if __name__ == "__main__":
    main()
