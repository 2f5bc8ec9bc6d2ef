"""Benchmarks fetching one object of the community's weights store: hearth's reader against nats-py's own.

    .venv/bin/python scripts/bench_weights_fetch.py [--mib 256] [--rounds 2]

Starts a fresh embedded nats-server, stores one object of `--mib` random bytes in the weights bucket, then fetches it
alternately with
1. `weights_objects.fetch_object` (hearth's reader: size and SHA-256 checked as the chunks arrive, fsynced), and
2. nats-py's `ObjectStore.get` into a file, then the file hashed (`file_sha256`), which is what fetching took before;
and prints MiB/s for each round as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.inference.checksum import file_sha256  # noqa: E402
from hearth.services.broker.connection import connect_nats  # noqa: E402
from hearth.services.broker.server import EmbeddedNatsServer  # noqa: E402
from hearth.services.weights_objects import fetch_object  # noqa: E402
from hearth.services.broker.permissions import WEIGHTS_BUCKET  # noqa: E402
from hearth.services.broker.weights_bucket import ensure_weights_bucket  # noqa: E402

OBJECT_KEY = "bench/layer-0"


@dataclass(frozen=True)
class BenchObject:
    file: str
    size: int
    sha256: str


async def run(url: str, mib: int, rounds: int, folder: Path) -> dict:
    nc = await connect_nats(url, name="bench-weights-fetch")
    js = nc.jetstream()
    await ensure_weights_bucket(js, 2 * mib * 2**20)  # as the steward's tooling makes it (room for the object)
    store = await js.object_store(WEIGHTS_BUCKET)
    data = os.urandom(mib * 2**20)
    await store.put(OBJECT_KEY, data)
    stored = BenchObject(file="layer-0.bin", size=len(data), sha256=hashlib.sha256(data).hexdigest())
    del data
    hearth_rates, nats_py_rates = [], []
    for _ in range(rounds):
        target = folder / stored.file
        target.unlink(missing_ok=True)
        started = time.perf_counter()
        await fetch_object(js, OBJECT_KEY, "bench", stored, folder)
        hearth_rates.append(mib / (time.perf_counter() - started))
        target.unlink()

        started = time.perf_counter()
        with target.open("wb") as out:
            await store.get(OBJECT_KEY, writeinto=out)
        assert await asyncio.to_thread(file_sha256, target) == stored.sha256
        nats_py_rates.append(mib / (time.perf_counter() - started))
        target.unlink()
    await nc.close()
    return {"mib": mib, "hearth_mib_per_s": [round(rate, 1) for rate in hearth_rates],
            "nats_py_get_then_hash_mib_per_s": [round(rate, 1) for rate in nats_py_rates]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the object's size in MiB")
    parser.add_argument("--rounds", type=int, default=2, help="alternated fetches of each reader")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-weights-fetch-") as scratch:
        server = EmbeddedNatsServer(store_dir=Path(scratch) / "nats")
        server.start()
        try:
            folder = Path(scratch) / "objects"
            folder.mkdir()
            print(json.dumps(asyncio.run(run(server.url, args.mib, args.rounds, folder))))
        finally:
            server.close()


if __name__ == "__main__":
    main()
