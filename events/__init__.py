"""hearth: events package."""
