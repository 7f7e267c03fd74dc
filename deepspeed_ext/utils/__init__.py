"""Small stdlib-only leaves (layer 0)."""
