"""torchjax/_compat/torch_saved_hooks.py: the private torch API of the saved-tensor hooks'
stack and switch, as torchjax uses it."""

import pytest
import torch

from torchjax import _patches
from torchjax._compat import torch_saved_hooks as sh


def _pack(t):
    return t


def _unpack(t):
    return t


def test_top_is_the_pair_pushed_and_pop_removes_it():
    assert sh.top_saved_tensors_default_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        top = sh.top_saved_tensors_default_hooks()
        assert top is not None and len(top) == 2
        assert sh.top_saved_tensors_default_hooks()[0] is top[0]  # the same objects
        # torchjax's wrapper keeps the user's functions (tensor/_backward_errors.py)
        assert top[0].__self__.pack_hook is _pack
        sh.pop_saved_tensors_default_hooks()
        assert sh.top_saved_tensors_default_hooks() is None
        torch._C._autograd._push_saved_tensors_default_hooks(*top)  # for __exit__
    assert sh.top_saved_tensors_default_hooks() is None


def test_top_ignores_dynamos_tracing_flag():
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        prior = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
        try:
            assert sh.top_saved_tensors_default_hooks() is not None
        finally:
            torch._C._autograd._saved_tensors_hooks_set_tracing(prior)


def test_the_switch_is_replaced_and_still_torchs_outside_a_trace():
    assert _patches.is_recorded("torch._C._autograd._saved_tensors_hooks_disable and _enable")
    autograd = torch._C._autograd
    for name in ("_saved_tensors_hooks_disable", "_saved_tensors_hooks_enable"):
        replaced = getattr(autograd, name)
        assert replaced.__wrapped__ is not replaced and replaced.__name__ == name
    with torch.autograd.graph.disable_saved_tensors_hooks("off here"):
        assert autograd._saved_tensors_hooks_get_disabled_error_message() == "off here"
        with pytest.raises(RuntimeError, match="off here"):
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                pass
    assert autograd._saved_tensors_hooks_is_enabled()
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        with pytest.raises(RuntimeError, match="not with hooks"):
            with torch.autograd.graph.disable_saved_tensors_hooks("not with hooks"):
                pass
        assert sh.top_saved_tensors_default_hooks()[0].__self__.pack_hook is _pack
    assert autograd._saved_tensors_hooks_is_enabled()
