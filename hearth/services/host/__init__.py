"""`hearth host`: a shard host that chooses its own layer range from the mesh's coverage and its memory budget."""
