"""Development tooling: `hearth bench`, `hearth eval`, `hearth demo`, local clusters, the prefork launcher, random
models and the network test bed. Nothing in production imports it; the CLI loads it lazily."""
