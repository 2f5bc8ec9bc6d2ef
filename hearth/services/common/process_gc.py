"""The garbage collector over a hearth process's life: no full collections while the process imports its modules,
then everything alive when its event loop starts frozen out of every later collection.

Why: importing torch and transformers leaves hundreds of thousands of objects that live as long as the process, and
each full (generation 2) collection scans every one of them while it holds the GIL: several times while a process
starts, whenever one falls due while it serves, and at exit. Young collections still run throughout, so short-lived
garbage cycles are freed as ever (BENCHMARKS.md, "Process start-up and the garbage collector")."""

from __future__ import annotations

import gc

# While importing, a full collection waits for this many generation-1 collections: in effect, none.
importing_full_collection_threshold = 1_000_000
# The generation-2 threshold the process had before full collections were held back (None: they are not held).
_held_full_threshold: int | None = None


def hold_full_collections() -> None:
    """Called first thing by a command: no full collections while it imports and sets up."""
    global _held_full_threshold
    young, middle, full = gc.get_threshold()
    if _held_full_threshold is None:
        _held_full_threshold = full
    gc.set_threshold(young, middle, importing_full_collection_threshold)


def freeze_startup_objects() -> None:
    """Called as the command's event loop starts, in a process that held full collections back: what is alive now is
    moved out of every later collection (it stays alive anyway), and full collections run again at their former
    threshold, over what is made from then on. Elsewhere (a test process running many loops) it does nothing: a
    freeze would keep whatever garbage exists at that moment for good."""
    global _held_full_threshold
    if _held_full_threshold is None:
        return
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _held_full_threshold)
    _held_full_threshold = None
