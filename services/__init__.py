"""hearth: services package."""
