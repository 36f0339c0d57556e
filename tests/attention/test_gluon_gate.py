"""The Gluon package's gates: which Triton releases compile the kernels (``COMPILABLE``) and
which the launchers use them under (``AVAILABLE``: releases whose GPU tests passed, or
``DSV41_GLUON=1``); the names ``_api`` bridges across releases. CPU only."""
import pytest
import triton

from dsv41_triton.attention import gluon as gluon_pkg


def test_release_gate(monkeypatch):
    monkeypatch.delenv("DSV41_GLUON", raising=False)
    for version in ("3.6.0", "3.6.1"):
        monkeypatch.setattr(triton, "__version__", version)
        assert gluon_pkg._release_reason() == ""
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    why = gluon_pkg._release_reason()
    assert "3.9.0" in why and "3.6" in why and "DSV41_GLUON=1" in why
    monkeypatch.setenv("DSV41_GLUON", "1")
    assert gluon_pkg._release_reason() == ""
    monkeypatch.setenv("DSV41_GLUON", "0")
    assert gluon_pkg._release_reason() == why


def test_gate_state_is_consistent():
    """AVAILABLE implies COMPILABLE; a closed gate says why; the installed release decides."""
    assert not gluon_pkg.AVAILABLE or gluon_pkg.COMPILABLE
    assert gluon_pkg.AVAILABLE or gluon_pkg.REASON
    if gluon_pkg.COMPILABLE:
        assert gluon_pkg.AVAILABLE == (gluon_pkg._release_reason() == "")


def test_bridged_names_are_the_installed_builtins():
    if not gluon_pkg.COMPILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API: {gluon_pkg.REASON}")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from dsv41_triton.attention.gluon import _api
    assert _api.barrier is getattr(gl, "barrier", getattr(gl, "thread_barrier", None))
    assert _api.async_load is getattr(cp, "async_load",
                                      getattr(cp, "async_copy_global_to_shared", None))
    assert bool(_api._PUBLIC_REINTERPRET) == hasattr(gl.shared_memory_descriptor, "reinterpret")
