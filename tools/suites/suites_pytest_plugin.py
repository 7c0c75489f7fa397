"""pytest plugin the suite runner loads into each third-party run (`-p suites_pytest_plugin`).

It gives every test a wall-clock limit (`SUITES_TEST_TIMEOUT` seconds; pytest-timeout is not
a dependency) and, when `SUITES_IMPORT_TORCHJAX=1`, imports torchjax before collection, which
PyTorch's `instantiate_device_type_tests` needs to see the "tpu" backend.
"""

import os
import signal

import pytest


class SuiteTestTimeout(Exception):
    """A test ran past the runner's per-test limit."""


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Before any conftest: one that imports torch's testing internals
    # (common_methods_invocations imports common_device_type) fixes the device types
    # instantiate_device_type_tests offers at that moment, so "tpu" must exist by then.
    _import_torchjax()


def pytest_configure(config):
    _import_torchjax()


def _import_torchjax():
    if os.environ.get("SUITES_IMPORT_TORCHJAX") == "1":
        import torchjax  # noqa: F401


def _on_alarm(signum, frame):
    limit = os.environ.get("SUITES_TEST_TIMEOUT")
    raise SuiteTestTimeout(f"test ran past the runner's {limit} s per-test limit")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Note [Per-test limit]: SIGALRM raises in the main thread at the next Python bytecode,
    # so a test stuck inside one long XLA compile is cut when that compile returns; the
    # runner's per-file limit covers the rest.
    limit = float(os.environ.get("SUITES_TEST_TIMEOUT", "0") or 0)
    if limit > 0:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        if limit > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
