"""The defaults of `hearth bench` and `hearth bench --together`: its command line and its runners read them here."""

default_prompt_tokens = 64
default_new_tokens = 32
default_sessions = 4
default_repeats = 3
# Shard processes per layer range: one, no replicas to check a hop's work.
default_replicas = 1
