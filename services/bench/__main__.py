"""`python -m services.bench PATH [THREADS]`: the monolithic generate() worker process (services.bench.monolithic)."""

import sys

from services.bench.monolithic import monolithic_worker_main

if __name__ == "__main__":
    monolithic_worker_main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
