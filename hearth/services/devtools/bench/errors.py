"""The one error every part of `hearth bench` raises when the benchmark cannot go on."""


class BenchError(RuntimeError):
    """The benchmark could not run (a process failed, a request ended in an error)."""
