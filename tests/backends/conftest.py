import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def opts(tmp_path):
    """Backend options for tiny test models: no MAC threshold, a private cache."""
    return {"min_compute_macs": 0, "cache_dir": str(tmp_path / "cache")}
