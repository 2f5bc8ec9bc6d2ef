"""What a NATS URL (`--nats`, `$HEARTH_NATS_URL`, [nats] url: one broker, or a cluster's nodes comma-separated) must
look like, checked before anything connects: nats-py's own parse ends a command in a traceback on a port out of range
or a URL it cannot read."""

from __future__ import annotations

from urllib.parse import urlsplit

NATS_URL_SCHEMES = ("nats", "tls", "ws", "wss")
# nats-py reads "host:port" and a bare "host" as nats:// URLs, the latter on its default port.
_DEFAULT_SCHEME = "nats"


def server_urls(url: str) -> list[str]:
    """The comma-separated NATS URLs in `url` (a cluster's nodes), as nats-py's `servers`; ValueError (one line
    naming the URL and what is wrong with it) when one is not a URL nats-py can connect to."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ValueError(f"no NATS URL in {url!r}")
    for part in urls:
        _check_one_url(part)
    return urls


def checked_nats_url(url: str) -> str:
    """`url` itself when every URL in it is one nats-py can connect to (see server_urls), else ValueError."""
    server_urls(url)
    return url


def _check_one_url(url: str) -> None:
    written = url if "://" in url else f"{_DEFAULT_SCHEME}://{url}"
    shown = url_without_password(url)
    try:
        parts = urlsplit(written)
        port = parts.port  # ValueError: not a number, or out of 0-65535
    except ValueError as error:
        raise ValueError(f"NATS URL {shown!r} is not a URL ({error})") from None
    if parts.scheme not in NATS_URL_SCHEMES:
        raise ValueError(f"NATS URL {shown!r}: scheme {parts.scheme!r} is not one of {', '.join(NATS_URL_SCHEMES)}")
    if not parts.hostname:
        raise ValueError(f"NATS URL {shown!r} names no host")
    if port == 0:
        raise ValueError(f"NATS URL {shown!r}: port 0 is no port a broker listens on")


def url_without_password(url: str) -> str:
    """`url` as a refusal may show it: a user:password@ in it written as ***@ (the line may end up in a log)."""
    scheme, separator, rest = url.rpartition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{separator}***@{rest.rpartition('@')[2]}"
