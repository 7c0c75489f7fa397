import pytest

from torchjax.ops import executables


@pytest.fixture
def fresh_executables():
    # For files that count compiles and traces (``pytestmark = pytest.mark.usefixtures(...)``):
    # both modes of a test start from empty caches (as in tests/ops/test_fused.py).
    executables.clear_caches()
