"""Read the two runs' junit XML, compare them and print / write the summary."""

import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict

# A failure whose message names the model hub: the test needs files we cannot download here.
_HUB = re.compile(
    r"huggingface\.co|OfflineModeIsEnabled|LocalEntryNotFound|HF_HUB_OFFLINE|outgoing traffic"
    r"|couldn't connect to|disk cache|is not a local folder and is not a valid model identifier"
)


# The skip reasons of PyTorch's device-type decorators (common_device_type.py).
_OTHER_DEVICE = re.compile(r"^Only runs on ")


def _skip_reason(results, name):
    outcome, cause = results.get(name, ("", ""))
    return cause if outcome == "skipped" else ""


def read_junit(path, normalize=lambda name: name):
    """Map each test id to (outcome, cause); outcome is passed / failed / skipped."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = normalize(f"{case.get('classname')}::{case.get('name')}")
        outcome, cause = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, cause = "failed", _cause(child)
                break
            if child.tag == "skipped":
                outcome, cause = "skipped", (child.get("message") or "")[:200]
        # A test that failed in call and again in teardown appears twice: the first wins.
        results.setdefault(name, (outcome, cause))
    return results


def _cause(node):
    """Exception type and first line of the message, as pytest's junit writer records it."""
    message = (node.get("message") or "").strip()
    if not message:
        message = (node.text or "").strip().splitlines()[-1:] or ["(no message)"]
        message = message[0]
    first = message.splitlines()[0] if message else "(no message)"
    first = re.sub(r"0x[0-9a-f]+", "0x...", first)
    return first[:200]


def compare(file, cpu, tpu):
    """The per-file figures: counts on each device and the CPU-passing tests failing on tpu."""
    names = sorted(set(cpu) | set(tpu))
    hub = [n for n in names if any(_HUB.search(r.get(n, ("", ""))[1]) for r in (cpu, tpu))]
    # Note [Tests for another device type]: a test that the tpu instantiation skips for
    # being written for other device types (PyTorch's onlyCPU, onlyOn("cuda")) is not a
    # tpu failure: it leaves the counts, and the summary lists it apart.
    other_device = [n for n in names if n not in hub and _OTHER_DEVICE.search(_skip_reason(tpu, n))]
    # pytest writes its XML when the session ends, so a tpu XML that lacks a CPU test
    # never collected it: the tpu instantiation does not have that variant (PyTorch's
    # dtypesIfCPU adds dtypes on CPU only). Such tests leave the rate too. An empty tpu
    # result (no XML: the run was cut) keeps every test, reported as not run.
    cpu_only = [n for n in names if tpu and n not in tpu and n not in hub]
    ran = [n for n in names if n not in hub and n not in other_device and n not in cpu_only]
    groups = defaultdict(list)
    for n in ran:
        if cpu.get(n, ("",))[0] == "passed" and tpu.get(n, ("missing",))[0] != "passed":
            outcome, cause = tpu.get(n, ("missing", "not run on tpu (no tpu results: run cut)"))
            groups[cause if outcome == "failed" else f"{outcome}: {cause}"].append(n)

    def count(results, outcome):
        return sum(1 for n in ran if results.get(n, ("",))[0] == outcome)

    # Tests CPU skips for wanting an accelerator (require_torch_accelerator and the like)
    # run on tpu only: reported apart, outside the CPU-passing rate.
    only = [n for n in ran if cpu.get(n, ("",))[0] == "skipped" != tpu.get(n, ("skipped",))[0]]
    only = [n for n in only if "accelerator" in cpu[n][1] or "GPU" in cpu[n][1]]
    only_failed = defaultdict(list)
    for n in only:
        if tpu[n][0] == "failed":
            only_failed[tpu[n][1]].append(n)

    cpu_pass = count(cpu, "passed")
    both = sum(1 for n in ran if cpu.get(n, ("",))[0] == "passed" == tpu.get(n, ("",))[0])
    return {
        "file": file,
        "collected": len(names),
        "hub_excluded": len(hub),
        "other_device_only": len(other_device),
        "not_collected_on_tpu": len(cpu_only),
        "cpu": {o: count(cpu, o) for o in ("passed", "failed", "skipped")},
        "tpu": {o: count(tpu, o) for o in ("passed", "failed", "skipped")},
        "cpu_passed_tpu_passed": both,
        "tpu_rate_of_cpu_passed": round(both / cpu_pass, 4) if cpu_pass else None,
        "cpu_passed_tpu_failed": dict(sorted(groups.items(), key=lambda kv: -len(kv[1]))),
        "accelerator_only": {
            "ran": len(only),
            "passed": sum(1 for n in only if tpu[n][0] == "passed"),
            "failed": dict(only_failed),
        },
    }


def print_summary(summary):
    s = summary
    print(f"\n== {s['file']}")
    print(
        f"collected {s['collected']} (hub-dependent, excluded: {s['hub_excluded']}; "
        f"for other device types only, excluded: {s.get('other_device_only', 0)}; "
        f"not collected on tpu, excluded: {s.get('not_collected_on_tpu', 0)}); "
        f"CPU passed {s['cpu']['passed']} failed {s['cpu']['failed']} "
        f"skipped {s['cpu']['skipped']}; tpu passed {s['tpu']['passed']} "
        f"failed {s['tpu']['failed']} skipped {s['tpu']['skipped']}"
    )
    rate = s["tpu_rate_of_cpu_passed"]
    print(
        f"of the {s['cpu']['passed']} CPU-passing tests, {s['cpu_passed_tpu_passed']} pass on tpu"
        + (f" ({100 * rate:.1f}%)" if rate is not None else "")
    )
    for cause, tests in s["cpu_passed_tpu_failed"].items():
        print(f"  [{len(tests)}] {cause}")
        for t in tests[:8]:
            print(f"      {t}")
        if len(tests) > 8:
            print(f"      ... and {len(tests) - 8} more")
    acc = s["accelerator_only"]
    if acc["ran"]:
        print(
            f"accelerator-only tests (skipped on CPU): {acc['passed']} of {acc['ran']} pass on tpu"
        )
        for cause, tests in acc["failed"].items():
            print(f"  [{len(tests)}] {cause}")
            for t in tests[:8]:
                print(f"      {t}")


def write_json(path, summaries, meta):
    with open(path, "w") as f:
        json.dump({"meta": meta, "files": summaries}, f, indent=1)
