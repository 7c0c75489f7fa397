"""The suite runner's comparison (tools/suites/_report.py, _pytorch.py) on small junit files."""

import argparse
import json
import os

from tools.suites import __main__ as main
from tools.suites import _pytorch, _report, _transformers

HUB = "OSError: We couldn't connect to 'https://huggingface.co'"


def _junit(cases):
    """A junit file: (name, child tag or None, message)."""
    body = []
    for name, tag, message in cases:
        child = f'<{tag} message="{message}">x</{tag}>' if tag else ""
        body.append(f'<testcase classname="t.A" name="{name}">{child}</testcase>')
    return "<testsuites><testsuite>" + "".join(body) + "</testsuite></testsuites>"


CPU = _junit(
    [
        ("test_ok", None, ""),
        ("test_breaks", None, ""),
        ("test_breaks_too", None, ""),
        ("test_cpu_fails", "failure", "AssertionError: no"),
        ("test_hub", "error", HUB),
        ("test_gpu", "skipped", "test requires accelerator"),
    ]
)
TPU = _junit(
    [
        ("test_ok", None, ""),
        ("test_breaks", "failure", "ValueError: at 0x7f12 bad&#10;more"),
        ("test_breaks_too", "failure", "ValueError: at 0x7f99 bad"),
        ("test_cpu_fails", None, ""),
        ("test_hub", "error", HUB),
        ("test_gpu", "failure", "RuntimeError: no kernel"),
    ]
)


def _summary(tmp_path):
    (tmp_path / "cpu.xml").write_text(CPU)
    (tmp_path / "tpu.xml").write_text(TPU)
    cpu = _report.read_junit(tmp_path / "cpu.xml")
    tpu = _report.read_junit(tmp_path / "tpu.xml")
    return _report.compare("t.py", cpu, tpu)


def test_counts_and_causes(tmp_path):
    s = _summary(tmp_path)
    assert s["collected"] == 6 and s["hub_excluded"] == 1
    assert s["cpu"] == {"passed": 3, "failed": 1, "skipped": 1}
    assert s["cpu_passed_tpu_passed"] == 1 and s["tpu_rate_of_cpu_passed"] == round(1 / 3, 4)
    # Grouped by exception type and first line, addresses blanked.
    assert s["cpu_passed_tpu_failed"] == {
        "ValueError: at 0x... bad": ["t.A::test_breaks", "t.A::test_breaks_too"]
    }
    assert s["accelerator_only"] == {
        "ran": 1,
        "passed": 0,
        "failed": {"RuntimeError: no kernel": ["t.A::test_gpu"]},
    }


def test_summary_is_printed_and_written(tmp_path, capsys):
    s = _summary(tmp_path)
    _report.print_summary(s)
    out = capsys.readouterr().out
    assert "of the 3 CPU-passing tests, 1 pass on tpu (33.3%)" in out
    assert "[2] ValueError: at 0x... bad" in out
    _report.write_json(tmp_path / "s.json", [s], {"suite": "t"})
    assert json.loads((tmp_path / "s.json").read_text())["files"][0]["collected"] == 6


def test_pytorch_ids_match_across_devices():
    cpu = _pytorch.normalize("test_view_ops.TestViewOpsCPU::test_flip_cpu_float32")
    tpu = _pytorch.normalize("test_view_ops.TestViewOpsPRIVATEUSE1::test_flip_tpu_float32")
    assert cpu == tpu == "test_view_ops.TestViewOps::test_flip_float32"
    assert _pytorch.normalize("m.TestXCPU::test_y_cpu") == "m.TestX::test_y"


def test_pytorch_trees_are_per_run(tmp_path):
    # Two runs at once used to rebuild one shared tree under each other.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "test_a.py").write_text("")
    tree, notes = _pytorch.build_tree(tmp_path / "cache", tmp_path / "src")
    assert tree.name == f"tree-pytorch-{os.getpid()}" and (tree / "test_a.py").exists()
    assert any("SOURCES.json" in n for n in notes)


def test_pytorch_sources_are_noted(tmp_path):
    src = {"test_a.py": {"repo": "pytorch/pytorch", "commit": "abc"}}
    (tmp_path / "SOURCES.json").write_text(json.dumps(src))
    _, notes = _pytorch.build_tree(tmp_path / "cache", tmp_path)
    assert "test_a.py: pytorch/pytorch at abc" in notes


def test_transformers_folder_sources_are_noted(tmp_path):
    # The model test files come from a stored upstream commit: the summary must say which.
    (tmp_path / "cache" / "transformers-9.9" / "tests").mkdir(parents=True)  # the sdist's
    folder = tmp_path / "folder"
    (folder / "tests" / "generation").mkdir(parents=True)
    (folder / "tests" / "generation" / "test_utils.py").write_text("")
    src = {
        "tests/generation/test_utils.py": {"repo": "org/transformers", "commit": "abc"},
        "tests/causal_lm_tester.py": {"repo": "org/transformers", "commit": "abc", "edited": "x"},
    }
    (folder / "SOURCES.json").write_text(json.dumps(src))
    _, notes = _transformers.build_tree(tmp_path / "cache", "9.9", folder, stub_missing=True)
    assert "tests/generation/test_utils.py: org/transformers at abc" in notes
    assert "tests/causal_lm_tester.py: org/transformers at abc (edited: x)" in notes


def test_keyword_tpu_run_compares_with_whole_file_cpu_run(tmp_path, monkeypatch):
    # A `-k` run on tpu alone used to report CPU 0/0: no CPU XML of its own.
    out = tmp_path / "results-pytorch"
    out.mkdir()
    (out / "t.cpu.xml").write_text(CPU)
    (out / f"{main._stem('t.py', 'test_breaks')}.tpu.xml").write_text(TPU)
    monkeypatch.setattr(main, "_run_one", lambda *a: None)
    args = argparse.Namespace(keyword="test_breaks", devices="tpu")
    s = main._run_file(args, None, lambda n: n, tmp_path, out, "t.py")
    assert s["cpu"]["passed"] == 3 and s["cpu_passed_tpu_passed"] == 1


def _compare_junit(tmp_path, cpu_cases, tpu_cases):
    """compare() of two runs given as _junit cases, read back from their XML files."""
    (tmp_path / "c.xml").write_text(_junit(cpu_cases))
    (tmp_path / "t.xml").write_text(_junit(tpu_cases))
    return _report.compare(
        "t.py", _report.read_junit(tmp_path / "c.xml"), _report.read_junit(tmp_path / "t.xml")
    )


def test_tests_for_other_device_types_leave_the_rate(tmp_path):
    # An onlyCPU test is skipped on tpu by design: it used to count as a tpu failure.
    cpu = [("test_a", None, ""), ("test_cpu_only", None, "")]
    tpu = [("test_a", None, ""), ("test_cpu_only", "skipped", "Only runs on cpu")]
    s = _compare_junit(tmp_path, cpu, tpu)
    assert s["other_device_only"] == 1 and s["cpu"]["passed"] == 1
    assert s["tpu_rate_of_cpu_passed"] == 1.0 and not s["cpu_passed_tpu_failed"]


def test_tpu_tests_are_offered_when_a_conftest_imports_torchs_test_internals(tmp_path):
    # A folder's conftest importing common_methods_invocations fixes the device types
    # before pytest_configure: the plugin imports torchjax before any conftest.
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "conftest.py").write_text(
        "import torch.testing._internal.common_methods_invocations  # noqa: F401\n"
    )
    (tmp_path / "test_dev.py").write_text(
        "from torch.testing._internal.common_device_type import instantiate_device_type_tests\n"
        "from torch.testing._internal.common_utils import TestCase\n"
        "class TestDev(TestCase):\n"
        "    def test_here(self, device):\n"
        "        pass\n"
        "instantiate_device_type_tests(TestDev, globals())\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    plugin_dir = Path(main.__file__).parent
    env = dict(os.environ, PYTORCH_TESTING_DEVICE_ONLY_FOR="tpu", SUITES_IMPORT_TORCHJAX="1")
    env["PYTHONPATH"] = str(plugin_dir)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "test_dev.py", "--co", "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:xdist", "-p", "suites_pytest_plugin", "-c", str(tmp_path / "pytest.ini")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "TestDevPRIVATEUSE1::test_here_tpu" in out.stdout, out.stdout + out.stderr


def test_variants_collected_on_cpu_only_leave_the_rate(tmp_path):
    # PyTorch's dtypesIfCPU instantiates some dtypes on CPU only: absent from a finished
    # tpu run's XML, they used to count as tpu failures ("the run stopped early").
    s = _compare_junit(
        tmp_path, [("test_a", None, ""), ("test_a_bfloat16", None, "")], [("test_a", None, "")]
    )
    assert s["not_collected_on_tpu"] == 1 and s["cpu"]["passed"] == 1
    assert s["tpu_rate_of_cpu_passed"] == 1.0 and not s["cpu_passed_tpu_failed"]
    # No tpu results at all (the run was cut before pytest wrote its XML): not run.
    s = _report.compare("t.py", _report.read_junit(tmp_path / "c.xml"), {})
    assert s["not_collected_on_tpu"] == 0
    assert sum(len(v) for v in s["cpu_passed_tpu_failed"].values()) == 2


def test_keyword_runs_that_begin_alike_keep_apart_results():
    from tools.suites.__main__ import _stem

    a = "TestCommon and float32 and test_variant_consistency_eager and nn_functional_a"
    b = "TestCommon and float32 and test_variant_consistency_eager and nn_functional_b"
    assert _stem("test_ops.py", a) != _stem("test_ops.py", b)
    assert _stem("test_ops.py", a) == _stem("test_ops.py", a)
    assert _stem("test_ops.py", None) == "test_ops"
