"""Host memory: the shared-memory arena (arena.py), the memory plan made before allocating (plan.py), and the version
table through which the executor, the optimizer workers and the driver agree on each unit's state (versions.py)."""
