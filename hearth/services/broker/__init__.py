"""The broker side: the embedded nats-server and its cluster, member permissions, TLS files, client connections and
the community's streams."""
