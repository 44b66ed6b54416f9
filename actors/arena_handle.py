"""How a worker or an executor opens its node's arena: from the parameter store's handle, perhaps still on its way.

The driver starts a run's workers and executors while the stores build their arenas (pipelines/run_actors.py), so
that their processes start and import torch meanwhile. Each is given its store's `handle` call as a reference inside
a list (Ray hands a nested reference over as it is, where one passed as an argument itself would hold the actor
back until the store is done) and waits for it here, in its __init__.
"""

from __future__ import annotations

import ray

from megatrain.memory.arena import Arena, ArenaHandle

# what a worker or an executor is given: a handle, or [the store's handle call] to wait for
HandleArg = ArenaHandle | list[ray.ObjectRef]


def open_arena(handle: HandleArg) -> Arena:
    """The arena `handle` names, once the store has made it."""
    if isinstance(handle, list):
        (ref,) = handle
        handle = ray.get(ref)
    return Arena.open(handle)
