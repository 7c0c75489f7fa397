"""CLI: `python -m tools.suites {transformers,pytorch} FILE... [options]` (docs/testing.md)."""

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import _pytorch, _report, _transformers

REPO = Path(__file__).resolve().parents[2]


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tools.suites", description=__doc__)
    p.add_argument("suite", choices=["transformers", "pytorch"])
    p.add_argument("files", nargs="+", help="test files, relative to the suite's tree root")
    p.add_argument("--folder", type=Path, help="test files laid out as in the suite's repository")
    p.add_argument("--stub-missing", action="store_true", help="empty mixins for absent modules")
    p.add_argument("--cache", type=Path, default=REPO / ".suites-cache")
    p.add_argument(
        "--devices", default="cpu,tpu", help='which runs; "" re-reads the last runs\' XML'
    )
    p.add_argument("-k", dest="keyword", help="pytest -k expression")
    p.add_argument("--test-timeout", type=float, default=300, help="seconds per test")
    p.add_argument("--file-timeout", type=float, default=3600, help="seconds per file and device")
    p.add_argument("--json", type=Path, help="summary path (default: CACHE/summary-SUITE.json)")
    return p.parse_args(argv)


def _pythonpath(cache: Path, device: str) -> str:
    """The plugin always; torchjax (this checkout's) only for the tpu run."""
    paths = [str(Path(__file__).parent)]
    if (cache / "deps").is_dir():
        paths.append(str(cache / "deps"))
    if device != "cpu":
        link_dir = cache / "pypath"
        link_dir.mkdir(parents=True, exist_ok=True)
        link = link_dir / "torchjax"
        if not link.exists():
            try:
                link.symlink_to(REPO / "torchjax")
            except FileExistsError:  # another run made it meanwhile
                pass
        paths.append(str(link_dir))
    return os.pathsep.join(paths)


def _run_one(args, suite, tree, file, device, xml):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(suite.device_env(device))
    env["PYTHONPATH"] = _pythonpath(args.cache, device)
    env["SUITES_TEST_TIMEOUT"] = str(args.test_timeout)
    cmd = ["nice", "-n", "19", sys.executable, "-m", "pytest", file, "-q", "-p", "no:xdist"]
    cmd += ["-p", "no:cacheprovider", "-p", "suites_pytest_plugin", "-c", str(tree / "pytest.ini")]
    cmd += ["--rootdir", str(tree), f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    start = time.monotonic()
    log = xml.with_suffix(".log")
    with open(log, "w") as out:
        try:
            subprocess.run(
                cmd,
                cwd=tree,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=args.file_timeout,
            )
        except subprocess.TimeoutExpired:
            print(
                f"{file} on {device}: cut at the {args.file_timeout} s file limit", file=sys.stderr
            )
    print(f"{file} on {device}: {time.monotonic() - start:.0f} s (log: {log})", file=sys.stderr)


def main(argv=None):
    args = _parse(argv)
    args.cache = args.cache.resolve()
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.suite == "transformers":
        suite, normalize = _transformers, (lambda n: n)
        version = _transformers.installed_version()
        folder = args.folder.resolve() if args.folder else None
        tree, notes = _transformers.build_tree(args.cache, version, folder, args.stub_missing)
        _transformers.install_test_deps(args.cache)
    else:
        if args.folder is None:
            raise SystemExit("pytorch needs --folder: a folder holding torch's test files")
        suite, normalize = _pytorch, _pytorch.normalize
        tree, notes = _pytorch.build_tree(args.cache, args.folder.resolve())
    out = args.cache / f"results-{args.suite}"
    out.mkdir(exist_ok=True)
    summaries = []
    try:
        for file in args.files:
            summaries.append(_run_file(args, suite, normalize, tree, out, file))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    for note in notes:
        print(f"note: {note}")
    meta = {"suite": args.suite, "notes": notes, "keyword": args.keyword}
    path = args.json or out / f"summary-{_stem(args.files[0], args.keyword)}.json"
    _report.write_json(path, summaries, meta)
    print(f"summary: {path}")


def _stem(file, keyword):
    stem = file.replace("/", "_").removesuffix(".py")
    if keyword:  # a -k run keeps its own results, beside the whole file's
        # The readable start of the expression, and a digest of all of it: two long
        # expressions that begin alike must not share (overwrite) their results.
        digest = hashlib.sha1(keyword.encode()).hexdigest()[:8]
        stem += "-k-" + re.sub(r"[^A-Za-z0-9_]+", "_", keyword)[:60] + "-" + digest
    return stem


def _read(xml, normalize, only=None):
    results = _report.read_junit(xml, normalize) if xml.exists() else {}
    return results if only is None else {n: r for n, r in results.items() if n in only}


def _run_file(args, suite, normalize, tree, out, file):
    stem = _stem(file, args.keyword)
    xmls = {d: out / f"{stem}.{d}.xml" for d in ("cpu", "tpu")}
    for device in filter(None, args.devices.split(",")):  # "" re-reads the last XML
        _run_one(args, suite, tree, file, device, xmls[device])
    tpu = _read(xmls["tpu"], normalize)
    cpu = _read(xmls["cpu"], normalize)
    if not cpu and args.keyword:
        # Note [A -k run against the whole file's CPU run]: a tpu-only `-k` run compares
        # with the same tests' results in the whole file's CPU run when that exists.
        cpu = _read(out / f"{_stem(file, None)}.cpu.xml", normalize, only=set(tpu))
    summary = _report.compare(file, cpu, tpu)
    _report.print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
