"""Exception types raised by the inference core, so callers can map them to wire error codes."""


class InferenceError(Exception):
    """Base class of every error the inference core raises on purpose."""


class UnsupportedArchitectureError(InferenceError):
    """The checkpoint's architecture has no adapter; raised at load time, before any weight is read."""


class CheckpointError(InferenceError):
    """The checkpoint folder is missing, incomplete or in a format hearth cannot read."""


class SessionStateError(InferenceError):
    """A step does not fit the session's cache (unknown session, or start_pos != tokens already cached).

    The usual cause is an evicted or reset session; the orchestrator recovers by re-prefilling.
    """


class SessionEvictedError(SessionStateError):
    """The session's cache was evicted (idle too long, or the least recently used when the KV budget ran out);
    the shard answers `session_evicted` and the orchestrator re-prefills."""


class SessionTooLargeError(InferenceError):
    """One session alone would need more KV-cache bytes than the runner's whole budget, or more positions than the
    model's context."""


class RunnerClosedError(InferenceError):
    """The runner was closed; its weights and caches are gone."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message (its type's name when it has none), for a one-line refusal."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
