"""`hearth schema`: writes docs/schemas/*.json and docs/configuration.md from the pydantic models, so they cannot drift.

The wire messages (the `llm.chat.request` body, each frame type streamed back, the model-discovery messages, each
event type) become one JSON Schema file each, listed in `schemas/index.json` (wire.py); `HearthSettings` becomes the
configuration reference (configuration.py). Every file is written byte for byte the same from the same models
(sorted keys, a trailing newline), so a test can compare the committed copies with what the models say now
(files.py, which also runs the command).
"""

COMMAND = "hearth schema"


def qualified_name(model: type) -> str:
    """Where a generated file says its model lives: `module.QualifiedName`."""
    return f"{model.__module__}.{model.__qualname__}"
