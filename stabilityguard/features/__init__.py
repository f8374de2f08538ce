"""Opt-in features of the guard (each off by default)."""
