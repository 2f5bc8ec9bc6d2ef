"""hearth: services/transport package."""
