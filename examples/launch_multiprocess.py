"""Run a script as N cooperating JAX processes on this machine (``jax.distributed``).

    python examples/launch_multiprocess.py --processes 2 --devices-per-process 4 \\
        examples/tp_generate.py --tp 8

starts the script N times, each with ``--xla_force_host_platform_device_count`` CPU
devices and the environment the script reads to call ``jax.distributed.initialize``
(``TORCHJAX_COORDINATOR``, ``TORCHJAX_NUM_PROCESSES``, ``TORCHJAX_PROCESS_ID``; see
``_distributed_init`` in examples/tp_generate.py). Process 0 hosts the coordinator on a
free localhost port; CPU collectives go through gloo. Every process's output is printed,
prefixed with its id; the exit status is the first non-zero one.

On a multi-host TPU pod the same script runs once per host (``gcloud ... ssh --worker=all``
or the cluster's launcher) and ``jax.distributed.initialize()`` needs no arguments: see
docs/sharding.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Run first in each child (``python -c _BOOT launcher_pid script args...``): ask the
# kernel for SIGKILL when the launcher dies (Linux prctl PR_SET_PDEATHSIG, kept across
# exec), give up if the launcher is already gone, then exec the script. Done in the
# child's own interpreter rather than a ``preexec_fn``: forking a process that runs JAX
# threads and running Python before exec can deadlock.
_BOOT = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _stop(procs) -> None:
    for q in procs:
        if q.poll() is None:
            q.kill()
    for q in procs:
        q.wait()


def _with_device_count(flags: str, devices: int) -> str:
    """``flags`` (the caller's XLA_FLAGS, kept) with the simulated device count set."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def launch(script: list[str], processes: int, devices: int, timeout: float) -> list[str]:
    """Start ``script`` (argv after the interpreter) ``processes`` times; return each
    process's output. RuntimeError (with the outputs) if one fails or times out.

    Each child writes to its own file, not a pipe: a pipe is drained only when read,
    so a process that prints more than the pipe buffer while the launcher waits on
    another one blocks, and its peer then waits forever in a collective. The first
    process to fail stops the others (they would wait for it in jax.distributed)."""
    port = free_port()
    procs, files = [], []
    for i in range(processes):
        env = dict(
            os.environ,
            XLA_FLAGS=_with_device_count(os.environ.get("XLA_FLAGS", ""), devices),
            JAX_PLATFORMS="cpu",
            TORCHJAX_COORDINATOR=f"127.0.0.1:{port}",
            TORCHJAX_NUM_PROCESSES=str(processes),
            TORCHJAX_PROCESS_ID=str(i),
        )
        log = tempfile.TemporaryFile(mode="w+")
        files.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(os.getpid()), *script],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    failed = []
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll()]
            if bad:
                failed.append(f"process {bad[0]} exited with {procs[bad[0]].returncode}")
                break
            if time.monotonic() > deadline:
                running = [i for i, p in enumerate(procs) if p.poll() is None]
                failed.append(f"process {running[0]} timed out after {timeout}s")
                break
            time.sleep(0.1)
    finally:
        _stop(procs)
    for i, p in enumerate(procs):
        if p.returncode and not failed:
            failed.append(f"process {i} exited with {p.returncode}")
    outputs = []
    for log in files:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if failed:
        joined = "\n".join(f"--- process {i} ---\n{o}" for i, o in enumerate(outputs))
        raise RuntimeError(f"{'; '.join(failed)}\n{joined}")
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help="start all processes again (new port) this many times after a timeout",
    )
    parser.add_argument("script", nargs=argparse.REMAINDER, help="script and its arguments")
    args = parser.parse_args()
    script = args.script or ["examples/tp_generate.py", "--tp", "8"]
    for attempt in range(args.retries + 1):
        try:
            outputs = launch(script, args.processes, args.devices_per_process, args.timeout)
            break
        except RuntimeError as error:
            # The gloo rendezvous on localhost sometimes hangs on a loaded machine (seen
            # on 2 cores); a timeout may be retried, any other failure is final.
            if "timed out" not in str(error).split("\n")[0] or attempt == args.retries:
                print(error, file=sys.stderr)
                sys.exit(1)
            print(f"attempt {attempt + 1} timed out; retrying", file=sys.stderr)
    for i, out in enumerate(outputs):
        for line in out.splitlines():
            print(f"[{i}] {line}")


if __name__ == "__main__":
    main()
