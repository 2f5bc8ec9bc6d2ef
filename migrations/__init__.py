"""hearth: migrations package."""
