"""Declaring a pair: the Side protocol, Pair, KnownDifference, stock sides and their checkpoint layout."""
