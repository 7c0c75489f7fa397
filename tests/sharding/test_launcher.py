"""examples/launch_multiprocess.py's process handling, with plain Python children (no
JAX): output that overflows a pipe buffer, a failing peer, and a killed launcher."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from examples import launch_multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_large_output_of_a_later_process_does_not_block(tmp_path):
    # Process 1 prints 1 MB and process 0 waits for it to finish, as a collective does:
    # through pipes read one after the other this deadlocked.
    done = tmp_path / "done"
    script = _script(
        tmp_path,
        f"""
        import os, sys, time
        if os.environ["TORCHJAX_PROCESS_ID"] == "1":
            sys.stdout.write("x" * 1_000_000 + "\\n")
            sys.stdout.flush()
            open({str(done)!r}, "w").close()
        else:
            while not os.path.exists({str(done)!r}):
                time.sleep(0.05)
        print("ok", os.environ["TORCHJAX_PROCESS_ID"])
        """,
    )
    outs = launch_multiprocess.launch([script], processes=2, devices=1, timeout=60)
    assert outs[0].strip() == "ok 0"
    assert outs[1].endswith("ok 1\n") and len(outs[1]) > 1_000_000


def test_a_failing_process_stops_the_others(tmp_path):
    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["TORCHJAX_PROCESS_ID"] == "1":
            print("giving up")
            sys.exit(3)
        time.sleep(120)  # a peer waiting for the failed one
        """,
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="process 1 exited with 3") as info:
        launch_multiprocess.launch([script], processes=2, devices=1, timeout=100)
    assert time.monotonic() - start < 30
    assert "giving up" in str(info.value)


def test_children_die_with_a_killed_launcher(tmp_path):
    pids = tmp_path / "pids"
    script = _script(
        tmp_path,
        f"""
        import os, time
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(120)
        """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "examples/launch_multiprocess.py", "--processes=2", script],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
        time.sleep(0.1)
    children = [int(p) for p in pids.read_text().split()]
    assert len(children) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _alive(p)]
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) is dead for this purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_children_keep_the_callers_xla_flags(tmp_path, monkeypatch):
    # The device count is set for each child; the caller's other flags (and no second
    # device count) reach it.
    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=3",
    )
    script = _script(tmp_path, 'import os; print(os.environ["XLA_FLAGS"])')
    outs = launch_multiprocess.launch([script], processes=2, devices=4, timeout=60)
    for out in outs:
        assert out.split() == [
            "--xla_backend_optimization_level=0",
            "--xla_force_host_platform_device_count=4",
        ]
