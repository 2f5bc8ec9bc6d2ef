"""The docs describe what the code defines: every frame type, event type and error code, and no file points outside.

Each name the code defines must appear, in backticks, in docs/protocol.md or docs/events.md; the lists are
read from the code (the ChatFrame union, events.models.EVENT_CLASSES, the ErrorCode literal), so a new
frame, event or code fails here until it is documented. And no file tracked by git may send its reader to
the design file outside the repository: the design is docs/design.md.
"""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import pytest

from hearth.events.models import EVENT_CLASSES
from hearth.protocol.chat_frames import ChatFrame, ErrorCode

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CATALOGUES = (DOCS / "protocol.md", DOCS / "events.md")
# Codes that are not in ErrorCode but that a reader meets: `pipeline.aborted` records a client that left.
EVENT_ONLY_CODES = ("client_gone",)
# Built in two pieces so that this file does not contain what it looks for.
OUTSIDE_DESIGN = "shared" + "/DESIGN"


def _documented_text() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in CATALOGUES)


def _undocumented(names: list[str]) -> list[str]:
    text = _documented_text()
    return [name for name in names if f"`{name}`" not in text]


def _union_members(union_type) -> list[type]:
    """The classes of a (possibly Annotated) Union, e.g. ChatFrame's frame classes."""
    args = typing.get_args(union_type)
    if typing.get_origin(union_type) is typing.Annotated:
        return _union_members(args[0])
    return list(args)


def frame_types() -> list[str]:
    return [member.model_fields["type"].default for member in _union_members(ChatFrame)]


def event_types() -> list[str]:
    return [event_class.model_fields["type"].default for event_class in EVENT_CLASSES]


def error_codes() -> list[str]:
    return [*typing.get_args(ErrorCode), *EVENT_ONLY_CODES]


def test_the_code_defines_what_is_checked():
    assert "token_delta" in frame_types() and "keepalive" in frame_types()
    assert "shard.advertised" in event_types()
    assert "bad_request" in error_codes()


@pytest.mark.parametrize("kind,names", [
    ("frame types (ChatFrame in hearth/protocol/chat_frames.py)", frame_types()),
    ("event types (EVENT_CLASSES in hearth/events/models.py)", event_types()),
    ("error codes (ErrorCode in hearth/protocol/chat_frames.py)", error_codes()),
])
def test_every_name_the_code_defines_is_documented(kind, names):
    missing = _undocumented(names)
    assert not missing, (f"{kind} not described in docs/protocol.md or docs/events.md (in backticks): "
                         f"{', '.join(missing)}")


def test_no_tracked_file_points_to_the_design_outside_the_repository():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    offenders = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        if OUTSIDE_DESIGN.encode() in path.read_bytes():
            offenders.append(name)
    assert not offenders, f"files referring to {OUTSIDE_DESIGN} (use docs/design.md): {', '.join(offenders)}"
