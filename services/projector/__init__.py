"""hearth: services/projector package."""
