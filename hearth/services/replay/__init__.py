"""hearth: services/replay package."""
