"""Model math: the families (each registers itself in registry.py), their templates and ops, and the arena layout."""
