"""`python -m hearth.services.devtools.bench PATH [THREADS [DEVICE DTYPE [QUANTIZE]]]`: the monolithic generate() worker
process (services.devtools.bench.monolithic); THREADS 0 keeps torch's own count."""

import sys

from hearth.services.devtools.bench.monolithic import monolithic_worker_main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    monolithic_worker_main(arguments[0], int(arguments[1]) or None if len(arguments) > 1 else None,
                           *(arguments[2:5] if len(arguments) >= 4 else ()))
