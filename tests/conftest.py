import pytest
import ray


@pytest.fixture(scope="session")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
             ignore_reinit_error=True)
    yield
    ray.shutdown()
