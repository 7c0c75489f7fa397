"""transformers' own tests: fetched from the installed version's source distribution.

Note [transformers test tree]: the sdist of transformers 5.x ships only the top-level
`tests/*_common.py` / `*_mixin.py` files, not `tests/models/` nor the modules those files
import (`tests/generation/test_utils.py`, `tests/exporters/test_export.py`,
`tests/causal_lm_tester.py`, `tests/utils/test_configuration_utils.py`). The user brings
those from transformers' repository in a folder laid out like it (`--tests-folder`), copied
over the sdist's tree; the sdist's files, which match the installed version exactly, are
never replaced by the folder's unless the folder holds the same path. A mixin module that
neither holds is replaced by an empty mixin class (`--stub-missing`), and the summary says
that mixin's tests were not run.
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from importlib.util import find_spec
from pathlib import Path

from . import folder_sources

# Files the common test files import or read, with the stand-in `--stub-missing` writes when
# neither the sdist nor the folder has one, and what the stand-in leaves out.
STUBBABLE = {
    "tests/generation/test_utils.py": (
        "class GenerationTesterMixin:\n    pass\n",
        "GenerationTesterMixin's tests",
    ),
    "tests/exporters/test_export.py": (
        "class ExportTesterMixin:\n    pass\n",
        "ExportTesterMixin's tests",
    ),
    # The pipeline tests load hub checkpoints named in this summary: hub-dependent here.
    "tests/utils/tiny_model_summary.json": ("{}\n", "PipelineTesterMixin's tests (hub models)"),
}


# What transformers' tests import beyond transformers' own dependencies, installed into the
# cache (`pip install --target`), not into the environment under test.
TEST_DEPS = ["parameterized==0.9.0"]


def install_test_deps(cache: Path) -> Path:
    target = cache / "deps"
    if not (target / ".installed").exists():
        pip = [sys.executable, "-m", "pip", "install", "--target", str(target), *TEST_DEPS]
        subprocess.run(pip, check=True)
        (target / ".installed").touch()
    return target


def installed_version():
    return importlib.metadata.version("transformers")


def fetch_sdist(cache: Path, version: str) -> Path:
    """Download and unpack transformers==version's sdist once; return the unpacked root."""
    root = cache / f"transformers-{version}"
    if (root / "tests").is_dir():
        return root
    dl = cache / "dl"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run(pip + [f"transformers=={version}", "-d", str(dl)], check=True)
    with tarfile.open(dl / f"transformers-{version}.tar.gz") as tar:
        tar.extractall(cache, filter="data")
    return root


def build_tree(cache: Path, version: str, folder: Path | None, stub_missing: bool):
    """Assemble the test tree; return (tree, notes about stubs and sources)."""
    sdist = fetch_sdist(cache, version)
    tree = cache / f"tree-transformers-{version}-{os.getpid()}"  # this run's own
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(sdist / "tests", tree / "tests")
    notes = [f"common test files from transformers=={version}'s sdist"]
    if folder is not None:
        shutil.copytree(folder, tree, dirs_exist_ok=True)
        notes += [f"other test files from {folder}", *folder_sources(folder)]
    for rel, (text, left_out) in STUBBABLE.items():
        path = tree / rel
        if path.exists():
            continue
        if not stub_missing:
            raise SystemExit(
                f"{rel} is in neither the sdist nor {folder}; bring it, or pass --stub-missing"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        notes.append(f"not run: {left_out} ({rel} not provided; a stand-in was written)")
    # The tests import each other relatively (`from ...test_modeling_common import ...`).
    for d in [tree / "tests", *(p for p in (tree / "tests").rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    # test_pipeline_mixin imports transformers from the tree's src/ by path: the installed one.
    (tree / "src").mkdir()
    (tree / "src" / "transformers").symlink_to(Path(find_spec("transformers").origin).parent)
    # Our own pyproject's pytest options must not apply to their tests.
    (tree / "pytest.ini").write_text("[pytest]\n")
    shutil.copy(Path(__file__).with_name("transformers_device_spec.py"), tree)
    return tree, notes


def device_env(device: str) -> dict:
    """Environment for one run: transformers' test-device variables."""
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        env["TRANSFORMERS_TEST_DEVICE"] = "cpu"
    else:
        # TRANSFORMERS_TEST_BACKEND imports torchjax before testing_utils checks that the
        # device exists; the spec (imported after that check) supplies the backend_* helpers.
        env["TRANSFORMERS_TEST_BACKEND"] = "torchjax"
        env["TRANSFORMERS_TEST_DEVICE"] = "tpu"
        env["TRANSFORMERS_TEST_DEVICE_SPEC"] = "transformers_device_spec.py"
    return env
