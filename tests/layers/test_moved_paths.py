"""The layer moved from ``dsv41_triton.attention`` to ``dsv41_triton.layers``: the old names
resolve to the same objects with a ``DeprecationWarning``, and ``attention`` does not import
``backends`` or ``layers`` (imports run ops <- attention <- backends <- layers <- perf)."""
import importlib
import subprocess
import sys
import warnings

import pytest

import dsv41_triton.layers as L

OLD_MODULES = ("layer", "config", "metadata", "scenario", "distributed")


def test_attention_does_not_import_backends_or_layers():
    code = ("import sys, dsv41_triton.attention; "
            "bad = [m for m in sys.modules if m.startswith(('dsv41_triton.backends', "
            "'dsv41_triton.layers'))]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_backends_do_not_import_layers():
    code = ("import sys, dsv41_triton.backends; "
            "bad = [m for m in sys.modules if m.startswith('dsv41_triton.layers')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(importlib.import_module("dsv41_triton.attention")._MOVED))
def test_old_package_names_warn_and_resolve(name):
    import dsv41_triton.attention as A

    with pytest.warns(DeprecationWarning, match=f"dsv41_triton.layers.{name}"):
        obj = getattr(A, name)
    assert obj is getattr(L, name)


@pytest.mark.parametrize("mod", OLD_MODULES)
def test_old_modules_warn_and_resolve(mod):
    sys.modules.pop(f"dsv41_triton.attention.{mod}", None)
    with pytest.warns(DeprecationWarning, match=f"dsv41_triton.layers.{mod}"):
        old = importlib.import_module(f"dsv41_triton.attention.{mod}")
    new = importlib.import_module(f"dsv41_triton.layers.{mod}")
    public = [k for k in vars(new) if not k.startswith("_")]
    assert public and all(getattr(old, k) is getattr(new, k) for k in public)


def test_new_paths_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from dsv41_triton import DeepseekV41Attention, build_step_metadata  # noqa: F401
        from dsv41_triton.layers import RequestSpec  # noqa: F401
        from dsv41_triton.layers.weights import shard_attention_state_dict  # noqa: F401


def test_unknown_attribute_still_raises():
    import dsv41_triton.attention as A

    with pytest.raises(AttributeError, match="no_such_name"):
        A.no_such_name  # noqa: B018
