"""tests/ray_site/sitecustomize.py: in the test run's Ray workers, Ray's serializer add-ons import neither pydantic
nor pyarrow (a Ray that renames those modules fails here, not as seconds lost), and megatrain's own use of pyarrow
(the parquet reader) imports it as usual."""

from __future__ import annotations

import sys

import ray


def test_ray_workers_skip_rays_add_ons_and_import_pyarrow_on_use(ray_session: None) -> None:
    @ray.remote(num_cpus=0)
    def modules_after_a_round_trip(table_rows: int) -> tuple[bool, bool, int]:
        skipped = "pydantic" not in sys.modules and "pyarrow" not in sys.modules  # after this task's arguments
        import pyarrow as pa

        return skipped, "pydantic" in sys.modules, pa.table({"tokens": list(range(table_rows))}).num_rows

    assert ray.get(modules_after_a_round_trip.remote(3)) == (True, False, 3)
