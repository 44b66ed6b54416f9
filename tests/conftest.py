import pytest
import ray


@pytest.fixture(scope="session")
def ray_session():
    # "local": a private Ray, also where `ray start` runs one (which ray.init() would join, refusing num_cpus)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
             ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True, scope="session")
def no_cached_calibration(tmp_path_factory: pytest.TempPathFactory):
    """Tests see no calibration of this machine (`megatrain calibrate` caches one in ~/.cache): what `plan` and
    `train` print must not depend on whether someone ran it here. Subprocesses inherit the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRAIN_CALIBRATION", str(tmp_path_factory.mktemp("calibration") / "none.json"))
        yield
