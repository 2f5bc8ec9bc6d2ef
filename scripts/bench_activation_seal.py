"""Benchmark of sealed activations (hearth/services/transport/seal.py): which AEAD, and what sealing costs a link.

1. The AEADs of the `cryptography` package on this CPU, for a typical decode frame (1x1x2048 fp32, 8 KiB) and a
   64-token prefill chunk (1x64x2048 fp32, 512 KiB): seal and open per frame, next to the BLAKE2b MAC that a
   MAC-only link computes over the same bytes.
2. One keyed link over a loopback nats-server (sender -> receiver, acks back), decode steps of 1x1x2048 fp32 and
   prefill steps of 1x64x2048 fp32: time from send() to next_step() returning the step, sealed and MAC-only in
   alternating blocks (so drift in machine load hits both alike).

Run::

    .venv/bin/python scripts/bench_activation_seal.py
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import time
from typing import Annotated

import torch
import typer
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from hearth.services.broker.connection import connect_nats
from hearth.services.broker.server import EmbeddedNatsServer
from hearth.services.transport import AckWindowSender, ActivationReceiver, FrameKind, StepInfo
from hearth.services.transport.mac import new_link_key

HIDDEN = 2048
FRAMES = {"decode 1x1x2048 fp32": (1, 1, HIDDEN), "prefill 1x64x2048 fp32": (1, 64, HIDDEN)}
ASSOCIATED_DATA = b"h" * 300  # about a frame's headers


def _per_call_us(action, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        action()
    return (time.perf_counter() - started) / repeats * 1e6


def aead_table(repeats_bytes: int) -> None:
    key = os.urandom(32)
    print("| frame | AES-256-GCM seal / open (µs) | ChaCha20-Poly1305 seal / open (µs) | BLAKE2b MAC (µs) |")
    print("| --- | --- | --- | --- |")
    for label, shape in FRAMES.items():
        data = memoryview(torch.randn(shape).numpy()).cast("B")
        repeats = max(20, repeats_bytes // data.nbytes)
        cells = []
        for cipher in (AESGCM(key), ChaCha20Poly1305(key)):
            nonce = os.urandom(12)
            sealed = cipher.encrypt(nonce, data, ASSOCIATED_DATA)
            seal_us = _per_call_us(lambda: cipher.encrypt(os.urandom(12), data, ASSOCIATED_DATA), repeats)
            open_us = _per_call_us(lambda: cipher.decrypt(nonce, sealed, ASSOCIATED_DATA), repeats)
            cells.append(f"{seal_us:.1f} / {open_us:.1f}")

        def mac() -> None:
            digest = hashlib.blake2b(key=key, digest_size=16)
            digest.update(ASSOCIATED_DATA)
            digest.update(data)
            digest.hexdigest()

        print(f"| {label} | {cells[0]} | {cells[1]} | {_per_call_us(mac, repeats):.1f} |")


async def _link_block(url: str, sealed: bool, shape: tuple[int, ...], steps: int, kind: FrameKind) -> list[float]:
    source = await connect_nats(url, name="seal-bench-source")
    sink = await connect_nats(url, name="seal-bench-sink")
    key = new_link_key()
    pipeline = f"seal-bench-{'s' if sealed else 'm'}-{time.monotonic_ns()}"
    tensor = torch.randn(shape)
    took = []
    try:
        async with ActivationReceiver(sink, pipeline, 0, link_key=key, seal=sealed) as receiver, \
                AckWindowSender(source, pipeline, 0, link_key=key, seal=sealed) as sender:
            for step in range(steps):
                started = time.perf_counter()
                await sender.send(StepInfo(session="s", step=step, kind=kind, pos=step), tensor)
                await receiver.next_step(10.0)
                took.append(time.perf_counter() - started)
            await sender.wait_all_acked(10.0)
    finally:
        await source.close()
        await sink.close()
    return took[2:]  # the first steps warm the subscriptions


async def link_table(url: str, blocks: int, steps: int) -> None:
    print("\n| link step (loopback nats-server) | MAC-only p50 (µs) | sealed p50 (µs) | sealed / MAC-only |")
    print("| --- | --- | --- | --- |")
    for label, shape in FRAMES.items():
        kind = FrameKind.decode if shape[1] == 1 else FrameKind.prefill
        samples: dict[bool, list[float]] = {False: [], True: []}
        for block in range(blocks):
            for sealed in ((False, True) if block % 2 == 0 else (True, False)):
                samples[sealed] += await _link_block(url, sealed, shape, steps, kind)
        mac_only, sealed = (statistics.median(samples[mode]) * 1e6 for mode in (False, True))
        print(f"| {label} | {mac_only:.0f} | {sealed:.0f} | {sealed / mac_only:.3f} |")


def main(
    blocks: Annotated[int, typer.Option(help="alternating blocks per mode")] = 6,
    steps: Annotated[int, typer.Option(help="steps per block")] = 200,
    repeats_mib: Annotated[int, typer.Option(help="MiB sealed per AEAD measurement")] = 64,
) -> None:
    print(f"CPU cores: {os.cpu_count()}; torch threads: {torch.get_num_threads()}\n")
    aead_table(repeats_mib * 1024 * 1024)
    server = EmbeddedNatsServer().start()
    try:
        asyncio.run(link_table(server.url, blocks, steps))
    finally:
        server.close()


if __name__ == "__main__":
    typer.run(main)
