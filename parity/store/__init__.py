"""Checkpoints on disk: Orbax save and restore across sides, and the streaming converter."""
