"""hearth: services/common package."""
