"""The chat client: the streaming call that `hearth chat`, `hearth models`, the gateway and the tools make."""
