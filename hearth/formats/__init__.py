"""What hearth serves of a checkpoint file format, told from the file's bytes alone: light (no torch), so that the
supervising `hearth demo` and the model side share one home for it (inference/ reads the files themselves)."""
