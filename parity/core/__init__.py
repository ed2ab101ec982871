"""Foundations of the kit: tree paths, errors, version compatibility, bitwise comparison, dropout keys, sharding specs."""
