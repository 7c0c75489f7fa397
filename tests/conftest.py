import pytest

import torchjax  # noqa: F401  (registers the "tpu" device before any test collects)
from torchjax.device import _checks


@pytest.fixture(autouse=True)
def _no_device_check_leaks_between_tests():
    # A test that makes a failing device check without synchronising (an error-input
    # sample, a test of the op's own raise) must not fail the next test at its first
    # sync (Note [Device-side checks]).
    yield
    _checks.clear_pending()
