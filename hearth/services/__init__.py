"""hearth's processes: the broker, shards, orchestrators, hosts, the projector, the gateway and their CLI."""
