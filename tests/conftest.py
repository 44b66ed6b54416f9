import pytest
import ray


@pytest.fixture(scope="session")
def ray_session():
    # "local": a private Ray, also where `ray start` runs one (which ray.init() would join, refusing num_cpus)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
             ignore_reinit_error=True)
    yield
    ray.shutdown()
