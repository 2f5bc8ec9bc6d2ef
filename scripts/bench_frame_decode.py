"""Measures what a client spends reading one answer frame: decode_frame of a token_delta frame with three hops."""

from __future__ import annotations

import argparse
import json
import time

from hearth.protocol.chat_frames import decode_frame

TOKEN_FRAME = json.dumps({"type": "token_delta", "seq": 12, "text": " Paris", "token_id": 3681,
                          "hops": ["smollm2:0-9@demo-host-0", "smollm2:10-19@demo-host-1",
                                   "smollm2:20-29@demo-host-2"]}).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (the range of their means is printed)")
    parser.add_argument("--frames", type=int, default=20_000, help="frames decoded a round")
    args = parser.parse_args()
    for _ in range(2000):  # warm up
        decode_frame(TOKEN_FRAME)
    means_us = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for _ in range(args.frames):
            decode_frame(TOKEN_FRAME)
        means_us.append((time.perf_counter() - started) / args.frames * 1e6)
    print(f"decode_frame, token_delta with 3 hops: {min(means_us):.2f}-{max(means_us):.2f} µs a frame")


if __name__ == "__main__":
    main()
