"""PyTorch's device-generic tests (`instantiate_device_type_tests`) from a user's folder.

PyTorch's test files are not in its wheel and its repository is too large to fetch here:
`--folder` holds them (for example test_view_ops.py from torch's `test/` at a version that
imports against the installed torch). The tpu run imports torchjax before collection
(`SUITES_IMPORT_TORCHJAX=1`) and keeps only the PrivateUse1 instantiation; the CPU run keeps
only the CPU one. Test ids are compared with the device suffixes removed.
"""

import os
import re
import shutil
from pathlib import Path

from . import folder_sources


def build_tree(cache: Path, folder: Path):
    """Copy the folder into a tree of this run's own (runs at once must not share one)."""
    tree = cache / f"tree-pytorch-{os.getpid()}"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(folder, tree)
    (tree / "pytest.ini").write_text("[pytest]\n")
    return tree, [f"PyTorch test files from {folder}", *folder_sources(folder)]


def device_env(device: str) -> dict:
    if device == "cpu":
        return {"PYTORCH_TESTING_DEVICE_ONLY_FOR": "cpu"}
    return {"PYTORCH_TESTING_DEVICE_ONLY_FOR": "tpu", "SUITES_IMPORT_TORCHJAX": "1"}


_SUFFIX = re.compile(r"(CPU|PRIVATEUSE1|TPU)(?=::)|_(cpu|tpu|privateuse1)(?=(_|$|\[))")


def normalize(test_id: str) -> str:
    """TestFooCPU::test_bar_cpu_float32 and TestFooPRIVATEUSE1::test_bar_tpu_float32 match."""
    return _SUFFIX.sub("", test_id)
