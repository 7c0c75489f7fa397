"""OpInfo coverage: run torch's op_db through torchjax's checks and print pass rates.

    python -m torchjax.testing.coverage [--ops SUBSTR ...] [--dtypes float32,int64]
                                        [--limit 2] [--jobs 2] [--checks forward,backward]

Runs the same checks as tests/ops (``torchjax.testing.checks.run_check``: forward values,
dtypes and shapes vs CPU torch, gradients, in-place, ``out=``; random ops through
``check_random``) without pytest, on the first ``--limit`` samples of each op and dtype,
in ``--jobs`` worker processes. Prints ops passed / tested for each check (an op passes a
check when every supported dtype among the harness dtypes passes it; backward counts
differentiable ops only), per-dtype pass counts, and the failures grouped by cause, each
marked listed or unlisted in tests/ops/expected_failures.csv. ``--print-xfails`` prints
the unlisted failures as lines for that file (reasons to be reviewed by hand).

    python -m torchjax.testing.coverage --from-suite run.xml [more.xml ...]

reads the outcomes of a real suite run instead, from pytest's junit XML
(``pytest tests/ops --junitxml=run.xml``; Note [Coverage from a run]).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import multiprocessing
import pathlib
import re
import signal
import sys
import time
import traceback

CHECKS = ("forward", "backward", "inplace", "out")
XFAIL_FILE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "ops" / "expected_failures.csv"

# Causes, in the order they are printed.
MISSING = "missing lowering"
VALUE = "value mismatch"
DTYPE = "dtype mismatch"
SHAPE = "shape mismatch"
RANDOM = "random-op check"
ERROR = "error mismatch"
CRASH = "crash"
LISTED = "listed in expected_failures.csv"
FAILED = "failed in the run"  # a suite run's failure (--from-suite)
CAUSES = (MISSING, VALUE, DTYPE, SHAPE, RANDOM, ERROR, CRASH, LISTED, FAILED)


@dataclasses.dataclass(frozen=True)
class Result:
    op: str
    dtype: str
    check: str
    cause: str | None  # None: passed
    detail: str = ""


def classify(exc: BaseException) -> tuple[str, str]:
    """(cause, detail) of a failed check."""
    msg = str(exc).strip()
    first = msg.splitlines()[0][:160] if msg else type(exc).__name__
    if isinstance(exc, NotImplementedError) and "torchjax has no lowering" in msg:
        m = re.search(r"aten::[\w.]+", msg)
        return MISSING, m.group(0) if m else first
    if isinstance(exc, AssertionError):
        if re.search(r": dtype \S+, CPU gave", msg):
            return DTYPE, first
        if re.search(r": shape \(.*\), CPU gave", msg) or "leaves vs" in msg:
            return SHAPE, first
        if "CPU raised" in msg:
            return ERROR, first
        if "manual_seed" in msg or "gave the same values" in msg or "values outside" in msg:
            return RANDOM, first
        return VALUE, " ".join(msg.split("\n")[:3])[:200]
    if isinstance(exc, TimeoutError):
        return CRASH, first
    frames = traceback.extract_tb(exc.__traceback__)
    in_jax = bool(frames) and re.search(r"[/\\]jax(lib)?[/\\]", frames[-1].filename)
    if isinstance(exc, (RuntimeError, ValueError, IndexError, TypeError)) and not in_jax:
        return ERROR, f"{type(exc).__name__}: {first}"
    return CRASH, f"{type(exc).__name__}: {first}"


def _alarm(signum, frame):
    raise TimeoutError("op took longer than --timeout seconds")


def run_op(name: str, dtypes, limit: int, checks, timeout: int) -> list[Result]:
    """Every check x dtype of one op_db entry; one Result each (cases that do not apply,
    e.g. backward of an int dtype, give none)."""
    import torch

    import torchjax  # noqa: F401  (registers the device)
    from torchjax.testing import opinfo as oi
    from torchjax.testing.checks import run_check

    (op,) = [o for o in oi.opinfos([name]) if oi.full_name(o) == name]
    supported = op.supported_dtypes("cpu")
    results = []
    for check in checks:
        for dtype in oi.DTYPES:
            dname = str(dtype).removeprefix("torch.")
            if dtype not in supported or (dtypes and dname not in dtypes):
                continue
            if check == "backward" and (
                not op.supports_autograd or dtype not in (torch.float32, torch.float64)
            ):
                continue
            if check == "inplace" and op.get_inplace() is None:
                continue
            if check == "out" and not op.supports_out:
                continue
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(timeout)
            try:
                samples = oi.samples(op, dtype, requires_grad=check == "backward", limit=limit)
                ran = [run_check(check, op, s) for s in samples]
                if check == "backward":
                    assert any(ran), "no sample had a differentiable output"
                results.append(Result(name, dname, check, None))
            except Exception as e:  # noqa: BLE001 - every failure is a result to report
                results.append(Result(name, dname, check, *classify(e)))
            finally:
                signal.alarm(0)
    return results


def _worker(job):
    import warnings

    warnings.simplefilter("ignore")
    name, dtypes, limit, checks, timeout = job
    try:
        return run_op(name, dtypes, limit, checks, timeout)
    except Exception as e:  # noqa: BLE001 - a crash in sample generation is still a result
        return [Result(name, "all", "forward", *classify(e))]


def op_names(filters=()) -> list[str]:
    """op_db entries CPU torch can run (``oi.reference_entries``), optionally filtered."""
    from torchjax.testing import opinfo as oi

    names = [oi.full_name(o) for o in oi.reference_entries()]
    return [n for n in names if not filters or any(f in n for f in filters)]


def load_xfails(path=XFAIL_FILE) -> dict[tuple[str, str, str], str]:
    with open(path, newline="") as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {(r["op"], r["dtype"], r["check"]): r["reason"] for r in rows}


def run(names, dtypes=(), limit=2, checks=CHECKS, jobs=1, timeout=300, progress=None):
    """Results of every op in ``names`` (in parallel when ``jobs`` > 1)."""
    jobs_args = [(n, tuple(dtypes), limit, tuple(checks), timeout) for n in names]
    results = []
    if jobs > 1:
        # spawn, not fork: jax's runtime threads do not survive a fork.
        with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=50) as pool:
            for i, rs in enumerate(pool.imap_unordered(_worker, jobs_args)):
                results.extend(rs)
                if progress:
                    progress(i + 1, len(names))
    else:
        for i, job in enumerate(jobs_args):
            results.extend(_worker(job))
            if progress:
                progress(i + 1, len(names))
    return results


def summarize(results, xfails=None, out=None, all_names=None) -> dict:
    """Print the report (to ``out``, default stdout); returns {check: (passed, tested)}."""
    out = sys.stdout if out is None else out
    xfails = load_xfails() if xfails is None else xfails
    p = lambda *a: print(*a, file=out)  # noqa: E731
    by_check = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in results:
        by_check[r.check][r.op].append(r)
    figures = {}
    p("ops passed / tested (an op passes when all its supported harness dtypes pass):")
    for check in CHECKS:
        ops = by_check.get(check, {})
        if not ops:
            continue
        passed = sum(all(r.cause is None for r in rs) for rs in ops.values())
        figures[check] = (passed, len(ops))
        label = "backward (differentiable ops)" if check == "backward" else check
        p(f"  {label:30s} {passed:4d} / {len(ops):4d}  ({100 * passed / len(ops):.1f}%)")
    if all_names is not None:
        tested = {r.op for r in results}
        untested = sorted(set(all_names) - tested)
        p(f"  not tested (no CPU dtype among the harness dtypes): {len(untested)}")
        if untested:
            p("    " + ", ".join(untested))
    p("\nper dtype, forward (op x dtype cases passed / tested):")
    per_dtype = collections.Counter()
    per_dtype_ok = collections.Counter()
    for r in results:
        if r.check == "forward":
            per_dtype[r.dtype] += 1
            per_dtype_ok[r.dtype] += r.cause is None
    for d, n in per_dtype.items():
        p(f"  {d:10s} {per_dtype_ok[d]:4d} / {n:4d}")
    failures = [r for r in results if r.cause is not None]
    p(f"\nfailures by cause ({len(failures)} op x dtype x check cases):")
    for cause in CAUSES:
        rs = [r for r in failures if r.cause == cause]
        if not rs:
            continue
        listed = sum((r.op, r.dtype, r.check) in xfails for r in rs)
        p(f"\n{cause}: {len(rs)} cases ({listed} listed, {len(rs) - listed} unlisted)")
        groups = collections.defaultdict(list)
        for r in rs:
            key = r.detail if cause == MISSING else r.op
            groups[key].append(r)
        for key, grs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            cases = ", ".join(
                f"{'' if cause != MISSING else r.op + ' '}{r.dtype}/{r.check}"
                f"{'' if (r.op, r.dtype, r.check) in xfails else ' (unlisted)'}"
                for r in grs
            )
            detail = "" if cause == MISSING else f" - {grs[0].detail}"
            p(f"  {key}: {cases}{detail}")
    passed = {(r.op, r.dtype, r.check) for r in results if r.cause is None}
    stale = sorted(k for k in xfails if k in passed)
    if stale:
        p(f"\nlisted in expected_failures.csv but passing here ({len(stale)}):")
        for k in stale:
            p("  " + ",".join(k))
    return figures


def xfail_lines(results, xfails) -> list[str]:
    """CSV lines for the unlisted failures (cause and first message line as reason)."""
    lines = []
    for r in results:
        if r.cause is not None and (r.op, r.dtype, r.check) not in xfails:
            reason = f"{r.cause}: {r.detail}".replace('"', "'")
            lines.append(f'{r.op},{r.dtype},{r.check},"{reason}"')
    return sorted(lines)


# Note [Coverage from a run]
# The suite's figures are counted from a real run: pytest's junit XML (``pytest tests/ops
# --junitxml=run.xml``) records each case's outcome, and ``--from-suite run.xml`` reads
# it: a case passed only if the run says so. A strict xfail is a listed failure (cause
# LISTED); a failure or error is counted as failed with the run's message; a case the
# suite defines but the XML lacks (a subset run, a crashed worker) is reported as not
# run and left out of the figures, which cover the cases that ran.
_CASE = re.compile(r"^test_opinfo_(forward|backward|inplace|out)\[(.+)-([a-z0-9]+)\]$")
# Family files whose own OpInfo tests use other names: factories (forward, and out= in
# the same test), empty-likes (forward: shape and dtype only, values are unspecified),
# the attention entries (dtype first).
_FACTORY_CASE = re.compile(r"^test_(factory|empty)_opinfo\[(.+)-torch\.([a-z0-9]+)\]$")
_ATTENTION_CASE = re.compile(
    r"^test_opinfo_attention_(forward|backward)\[torch\.([a-z0-9]+)-(.+)\]$"
)


def _case_keys(name: str) -> list[tuple[str, str, str]]:
    """The (op, dtype, check) cases one junit test case name stands for."""
    m = _CASE.match(name)
    if m is not None:
        check, op, dtype = m.groups()
        return [(op, dtype, check)]
    m = _FACTORY_CASE.match(name)
    if m is not None:
        kind, op, dtype = m.groups()
        checks = ("forward", "out") if kind == "factory" else ("forward",)
        return [(op, dtype, c) for c in checks]
    m = _ATTENTION_CASE.match(name)
    if m is not None:
        check, dtype, op = m.groups()
        return [(op, dtype, check)]
    return []


def junit_outcomes(paths) -> tuple[dict, collections.Counter]:
    """{(op, dtype, check): (cause, detail)} for the OpInfo cases in pytest junit XML
    files, and the outcome counts of every test case in them (passed, failed, ...)."""
    import xml.etree.ElementTree as ET

    cases, totals = {}, collections.Counter()
    for path in paths:
        for tc in ET.parse(path).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for child in tc:
                if child.tag in ("failure", "error"):
                    outcome = "failed" if child.tag == "failure" else "error"
                    detail = child.get("message") or ""
                elif child.tag == "skipped":
                    kind = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                    outcome, detail = kind, child.get("message") or ""
            totals[outcome] += 1
            cause = {"passed": None, "xfailed": LISTED}.get(outcome, FAILED)
            for key in _case_keys(tc.get("name", "")):
                cases[key] = (cause, " ".join(detail.split())[:160])
    return cases, totals


def suite_cases() -> list[tuple[str, str, str]]:
    """Every (op, dtype, check) the test suite defines (``opinfo.check_dtypes`` picks
    each entry's dtypes per check, for tests/ops/opinfo_cases.py and here alike)."""
    from torchjax.testing import opinfo as oi

    return [
        (oi.full_name(op), str(dtype).removeprefix("torch."), check)
        for op in oi.reference_entries()
        for check in CHECKS
        for dtype in oi.check_dtypes(op, check)
    ]


def suite_results(paths, out=None) -> list[Result]:
    """The OpInfo cases of a suite run, from its junit XML (Note [Coverage from a run]);
    prints the run's totals and the suite's cases it lacks."""
    out = sys.stdout if out is None else out
    cases, totals = junit_outcomes(paths)
    order = ("passed", "failed", "error", "xfailed", "skipped")
    print("test cases in the run: " + ", ".join(f"{totals[k]} {k}" for k in order), file=out)
    missing = [k for k in suite_cases() if k not in cases]
    print(f"OpInfo cases in the run: {len(cases)}; suite cases not in it: {len(missing)}", file=out)
    if missing:
        shown = ", ".join("/".join(k) for k in missing[:20])
        print(f"  not run: {shown}{' ...' if len(missing) > 20 else ''}", file=out)
    print(file=out)
    return [Result(op, d, c, cause, detail) for (op, d, c), (cause, detail) in cases.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="*", default=(), help="substrings of op_db names")
    parser.add_argument("--dtypes", default="", help="comma-separated, e.g. float32,int64")
    parser.add_argument("--limit", type=int, default=2, help="samples per op and dtype")
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per op")
    parser.add_argument("--xfails", default=str(XFAIL_FILE), help="expected-failures CSV")
    parser.add_argument("--print-xfails", action="store_true", help="CSV lines for unlisted")
    parser.add_argument(
        "--from-suite",
        nargs="+",
        metavar="JUNIT_XML",
        help="report the outcomes of a test-suite run from its junit XML "
        "(`pytest tests/ops --junitxml=run.xml`) instead of running checks",
    )
    args = parser.parse_args(argv)
    if args.from_suite:
        xfails = load_xfails(args.xfails)
        names = ", ".join(pathlib.Path(p).name for p in args.from_suite)
        print(f"torchjax OpInfo coverage counted from a test-suite run ({names})\n")
        results = suite_results(args.from_suite)
        summarize(results, xfails)
        return 0
    names = op_names(args.ops)
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    checks = tuple(c for c in args.checks.split(",") if c)
    start = time.monotonic()

    def progress(done, total):
        if sys.stderr.isatty() or done == total or done % 50 == 0:
            print(f"\r{done}/{total} ops", end="\n" if done == total else "", file=sys.stderr)

    results = run(names, dtypes, args.limit, checks, args.jobs, args.timeout, progress)
    print(
        f"torchjax OpInfo coverage: {len(names)} op_db entries, limit {args.limit} samples "
        f"per op and dtype, {args.jobs} jobs, {time.monotonic() - start:.0f} s\n"
    )
    xfails = load_xfails(args.xfails)
    summarize(results, xfails, all_names=names)
    if args.print_xfails:
        print("\n# unlisted failures, as expected_failures.csv lines:")
        print("\n".join(xfail_lines(results, xfails)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
