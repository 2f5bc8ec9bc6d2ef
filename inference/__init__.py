"""hearth: inference package."""
