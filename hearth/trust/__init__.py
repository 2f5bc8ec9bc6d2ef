"""Who belongs to a community mesh and how they prove it: member keys (NATS nkeys), the roster, and the NATS
server's per-role permissions rendered from it. Depends on nothing else of hearth's, so every process can use it."""
