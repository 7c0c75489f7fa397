"""The counters of captured module calls (Note [Captured module calls] in
torchjax/compile/_captured.py), for tests of when a call is captured."""

import torchjax


def capture_counts() -> tuple[int, int, int]:
    """(calls run by a captured program, traces of one, signatures refused) since the
    last ``torchjax.reset_stats()``."""
    s = torchjax.stats()
    return s["captured_calls"], s["capture_traces"], s["capture_refusals"]
