"""hearth: services/orchestrator package."""
