"""Ray's worker processes in a test run start without the serializer add-ons megatrain never uses.

conftest.py puts this directory on PYTHONPATH, so every Python process a test starts runs this file; it acts only in
Ray's worker processes (default_worker.py), where actors and tasks run. A worker's first (de)serialization registers
Ray's add-ons: cloudpickle serializers for pydantic's ModelField (Ray Serve, FastAPI), and an import of pyarrow for
Ray Data's Arrow tables (whose serializers conftest.py switches off with RAY_DISABLE_CUSTOM_ARROW_*). That costs
~0.28 CPU-s in each of the ~300 worker processes a test run starts, for types megatrain never passes through Ray.
Here those two add-ons find neither package, as on a minimal Ray install, and register nothing. Any other import of
pydantic or pyarrow is untouched: megatrain's parquet reader in the data loader actor imports pyarrow as usual.
"""

import importlib.abc
import sys

RAYS_ADD_ONS = {"pydantic": "ray._common.pydantic_compat", "pyarrow": "ray._private.arrow_serialization"}


def _importer() -> str:
    """The module whose import statement runs (the first frame outside importlib's machinery)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")


class _NotForRaysAddOns(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if name in RAYS_ADD_ONS and _importer() == RAYS_ADD_ONS[name]:
            raise ModuleNotFoundError(f"no {name} for Ray's serializer add-on in a test run", name=name)
        return None


if any(arg.endswith("default_worker.py") for arg in sys.argv):
    sys.meta_path.insert(0, _NotForRaysAddOns())
