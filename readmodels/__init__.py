"""hearth: readmodels package."""
