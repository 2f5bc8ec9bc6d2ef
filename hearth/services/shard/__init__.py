"""hearth: services/shard package."""
