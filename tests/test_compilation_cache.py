"""torchjax/_compilation_cache.py: JAX's persistent compilation cache is on by default in
the user's cache directory, a second process loads instead of compiling, the user's own
choice is kept, and torchjax.uninstall() turns it off again (Note [Persistent
compilation cache])."""

import json
import os
import pathlib
import stat

import jax
import pytest

import torchjax
from tests._child import once_per_run, run_python
from torchjax import _compilation_cache

# Two ops (a new float32 program each) and a report of what the process did.
_OPS = """
    import json, os
    import jax, torch, torchjax
    x = torch.arange(12.0, device="tpu").reshape(3, 4)
    y = (x * 3 + 1).softmax(-1)
    assert abs(y.sum().item() - 3.0) < 1e-5
    s = torchjax.stats()
    print("RESULT " + json.dumps({
        "dir": jax.config.jax_compilation_cache_dir,
        "min_time": jax.config.jax_persistent_cache_min_compile_time_secs,
        "patched": "jax persistent compilation cache" in [p.name for p in torchjax.patches()],
        "compiles": s["compiles"], "hits": s["persistent_cache_hits"],
    }))
"""


def _report(env, code=_OPS) -> dict:
    out = run_python(code, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _files(path) -> list:
    return [f for _, _, fs in os.walk(path) for f in fs]


def test_on_by_default_in_the_users_cache_dir_and_a_second_process_loads(tmp_path):
    env = {"TORCHJAX_COMPILATION_CACHE": "", "XDG_CACHE_HOME": str(tmp_path)}
    first = _report(env)
    cache = tmp_path / "torchjax" / "jax"
    assert first["dir"] == str(cache) and first["patched"]
    assert first["min_time"] == 0.0  # the eager programs compile in milliseconds
    assert first["compiles"] >= 2 and first["hits"] == 0
    assert len(_files(cache)) >= first["compiles"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    second = _report(env)
    assert second["compiles"] == 0
    assert second["hits"] == first["compiles"]


def test_a_path_in_the_variable_is_the_directory(path_then_uninstall):
    cache, r = path_then_uninstall
    assert r["dir_before"] == str(cache) and r["written"] > 0
    assert _files(cache)


def test_the_users_own_cache_settings_are_kept(tmp_path):
    env = {
        "TORCHJAX_COMPILATION_CACHE": "",
        "XDG_CACHE_HOME": str(tmp_path / "home"),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine"),
    }
    r = _report(env)
    assert r["dir"] == str(tmp_path / "mine") and not r["patched"]
    assert r["min_time"] == 1.0  # jax's default, as the user left it
    assert not (tmp_path / "home").exists()
    # A minimum compile time the user chose is kept as well.
    env = {
        "TORCHJAX_COMPILATION_CACHE": str(tmp_path / "c"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2.5",
    }
    r = _report(env)
    assert r["patched"] and r["min_time"] == 2.5


@pytest.fixture(scope="module")
def path_then_uninstall(request, tmp_path_factory):
    # One child for a path in the variable, then torchjax.uninstall() (importing torch
    # and jax is most of a child's time): programs compiled before the undo are written
    # to that path, those compiled after it are not.
    def make():
        cache = tmp_path_factory.mktemp("cache") / "elsewhere"  # made by torchjax
        return [
            str(cache),
            _report({"TORCHJAX_COMPILATION_CACHE": str(cache)}, _UNINSTALL % str(cache)),
        ]

    cache, report = once_per_run(request, tmp_path_factory, "path_then_uninstall", make)
    return pathlib.Path(cache), report


_UNINSTALL = """
        import json
        import jax, torch, torchjax
        before = jax.config.jax_compilation_cache_dir
        x = torch.ones(5, device="tpu")
        (x + 2).sum().item()
        torchjax.uninstall()
        written = sum(len(f) for _, _, f in __import__("os").walk(%r))
        (x * 7 - 1).cumsum(0).tolist()  # new programs, compiled after the undo
        print("RESULT " + json.dumps({
            "dir_before": before,
            "dir": jax.config.jax_compilation_cache_dir,
            "min_time": jax.config.jax_persistent_cache_min_compile_time_secs,
            "written": written,
        }))
    """


def test_uninstall_turns_it_off(path_then_uninstall):
    cache, r = path_then_uninstall
    assert r["dir"] is None and r["min_time"] == 1.0
    assert r["written"] > 0 and len(_files(cache)) == r["written"]


def test_zero_turns_it_off():
    # This process: tests/conftest.py sets "0" before importing torchjax (Note [The suite
    # and the persistent compilation cache]); the other spellings by the parser itself.
    assert os.environ["TORCHJAX_COMPILATION_CACHE"] == "0"
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0  # jax's default
    assert _compilation_cache.PATCH not in [p.name for p in torchjax.patches()]
    for value in ("0", "off", "False", "NO"):
        assert _compilation_cache.chosen_dir(value) is None


def test_chosen_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = str(tmp_path / "torchjax" / "jax")
    assert _compilation_cache.chosen_dir(None) == default
    assert _compilation_cache.chosen_dir(" 1 ") == default
    assert _compilation_cache.chosen_dir("0") is None
    assert _compilation_cache.chosen_dir("NO") is None
    assert _compilation_cache.chosen_dir("~/x") == os.path.expanduser("~/x")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _compilation_cache.default_dir() == os.path.expanduser("~/.cache/torchjax/jax")
