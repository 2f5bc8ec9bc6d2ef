"""How an invalid configuration is described: one line naming each wrong setting by where it was given (its
`HEARTH_*` environment variable, else its key in the TOML file) and what is wrong with it."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from hearth.protocol.refusals import max_described_problems

# pydantic's words for a key the model does not have; a household reads "unknown key" faster.
_UNKNOWN_KEY_TYPE = "extra_forbidden"
_VALUE_ERROR_PREFIX = "Value error, "


def describe_invalid_configuration(error: ValidationError, toml_path: Path | None, env_prefix: str,
                                   env_delimiter: str) -> str:
    """One line naming the settings `error` refused, the first `max_described_problems` of them."""
    problems = []
    for item in error.errors(include_url=False)[:max_described_problems]:
        message = ("unknown key (a typo? `hearth docs configuration` names the page listing every key)"
                   if item["type"] == _UNKNOWN_KEY_TYPE else str(item["msg"]).removeprefix(_VALUE_ERROR_PREFIX))
        location = tuple(str(part) for part in item["loc"])
        where = _where_given(location, toml_path, env_prefix, env_delimiter)
        problems.append(f"{where}: {message}" if where else message)
    if error.error_count() > max_described_problems:
        problems.append(f"and {error.error_count() - max_described_problems} more")
    return "invalid configuration: " + "; ".join(problems)


def _where_given(location: tuple[str, ...], toml_path: Path | None, env_prefix: str, env_delimiter: str) -> str:
    """`$HEARTH_NATS__CONNECT_TIMEOUT_S` when that variable is set, else `[nats] connect_timeout_s in FILE`."""
    if not location:
        return ""
    env_name = (env_prefix + env_delimiter.join(location)).upper()
    if any(name.upper() == env_name for name in os.environ):
        return f"${env_name}"
    key = f"[{'.'.join(location[:-1])}] {location[-1]}" if len(location) > 1 else f"[{location[0]}]"
    return f"{key} in {toml_path}" if toml_path is not None else key
