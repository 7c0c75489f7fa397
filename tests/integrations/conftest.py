"""The tiny Llama of examples/tiny_llama_generate.py, saved once per test module, and its
CPU reference model."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from examples import tiny_llama_generate as tl  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tl.save_tiny_llama(str(path))
    return str(path)


@pytest.fixture(scope="module")
def cpu(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
