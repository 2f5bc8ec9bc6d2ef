"""hearth: one LLM served by the machines of a community; every package of hearth lives under this one name."""
