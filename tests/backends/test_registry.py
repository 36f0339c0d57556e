"""The dispatcher: probes never raise, auto policy, explicit choices, DSV41_BACKEND."""
from __future__ import annotations

import pytest
import torch

from dsv41_triton import backends as B
from dsv41_triton.backends import Availability, AttentionBackend, Problem, registry

CPU = torch.device("cpu")
GPU = torch.device("cuda")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    saved = dict(registry._FACTORIES), dict(registry._INSTANCES)
    yield
    registry._FACTORIES.clear()
    registry._FACTORIES.update(saved[0])
    registry._INSTANCES.clear()
    registry._INSTANCES.update(saved[1])


class Fake(AttentionBackend):
    """A test double: available when ``ok``; records the problems it was probed with."""

    def __init__(self, name, ok=True, auto=True, raises=False):
        self.name, self.ok, self.auto, self.raises = name, ok, auto, raises
        self.seen = []

    def probe(self, problem):
        self.seen.append(problem)
        if self.raises:
            raise RuntimeError("boom")
        return Availability(self.ok, f"{self.name} says {'yes' if self.ok else 'no'}", self.auto)


def _install(**fakes):
    for name, fake in fakes.items():
        B.register_backend(name, lambda f=fake: f)


def test_every_backend_probes_without_raising_on_odd_problems():
    odd = [
        Problem("decode", 1), Problem("prefill", 3), Problem("decode_fused", 8),
        Problem("prefill_fused", 8, layout="interleaved"),
        Problem("decode", 200, device=GPU, capability=(9, 0)),
        Problem("decode", 64, device=GPU, capability=(10, 0), swa_record=288, extra_record=288),
        Problem("decode_fused", 64, device=GPU, capability=(10, 0), swa_record=528,
                extra_record=288),
        Problem("decode", 64, device=GPU, capability=(8, 0)),
        Problem("bogus", 8), Problem("decode", 0), Problem("decode_fused", 12),
        Problem("decode", 8, device=torch.device("meta")),
    ]
    for p in odd:
        for name, a in B.probe_all(p).items():
            assert isinstance(a, Availability) and isinstance(a.reason, str) and a.reason, (name, p)


def test_malformed_problems_are_unavailable_with_a_reason():
    assert not B.probe("torch", Problem("bogus", 8))
    assert "num_heads" in B.probe("torch", Problem("decode", 0)).reason
    assert "multiple of 8" in B.probe("torch", Problem("decode_fused", 12)).reason


def test_torch_is_available_on_cpu_and_auto_picks_it():
    p = [Problem("decode", 3, extra_record=288), Problem("prefill", 3)]
    sel = B.select_backend("auto", p)
    assert sel.name == "torch"
    assert "auto picked torch" in sel.reason and "passed over" in sel.reason
    assert "torch" in B.available_backends(p)


def test_triton_in_the_interpreter_is_available_but_not_auto():
    a = B.probe("triton", Problem("decode", 3))
    if a.available:
        assert not a.auto and "interpreter" in a.reason
        assert B.select_backend("auto", Problem("decode", 3)).name == "torch"
        assert B.select_backend("triton", Problem("decode", 3)).name == "triton"


def test_flashmla_reasons_name_the_missing_piece():
    a = B.probe("flashmla", Problem("decode", 64, device=GPU, capability=(9, 0)))
    if not a.available:  # here: no FlashMLA package
        assert "flash_mla" in a.reason or "FlashMLA" in a.reason
    a = B.probe("flashmla", Problem("decode", 64, device=GPU, capability=(8, 0)))
    assert not a and "sm_80" in a.reason
    a = B.probe("flashmla", Problem("decode", 64, device=CPU))
    assert not a and "CUDA" in a.reason
    a = B.probe("flashmla", Problem("decode", 200, device=GPU, capability=(9, 0)))
    assert not a and "128" in a.reason
    a = B.probe("flashmla", Problem("decode", 64, device=GPU, capability=(9, 0), swa_record=528))
    assert not a and "528" in a.reason
    a = B.probe("flashmla", Problem("decode", 64, device=GPU, capability=(9, 0), extra_record=288))
    assert not a and "288" in a.reason


def test_triton_needs_sm80_on_cuda():
    a = B.probe("triton", Problem("decode", 8, device=GPU, capability=(7, 5)))
    assert not a and "sm_80" in a.reason and "sm_75" in a.reason
    for cap in ((8, 0), (8, 9), (9, 0), (12, 0)):
        assert B.probe("triton", Problem("decode", 8, device=GPU, capability=cap)), cap


def test_mega_reasons():
    a = B.probe("flashmla_mega", Problem("decode", 64, device=GPU, capability=(10, 0)))
    assert not a and "fused" in a.reason
    a = B.probe("flashmla_mega", Problem("decode_fused", 64, device=GPU, capability=(9, 0),
                                         swa_record=528))
    assert not a and "sm_90" in a.reason
    a = B.probe("flashmla_mega", Problem("decode_fused", 64, device=GPU, capability=(10, 0),
                                         swa_record=584))
    assert not a and "528" in a.reason


def test_explicit_unavailable_raises_with_the_reason():
    with pytest.raises(RuntimeError, match="flashmla.*CUDA"):
        B.select_backend("flashmla", Problem("decode", 64))
    with pytest.raises(ValueError, match="unknown backend"):
        B.select_backend("nope", Problem("decode", 8))
    with pytest.raises(TypeError):
        B.select_backend("auto")


def test_auto_order_and_head_policy():
    mega, fm, tr, to = Fake("flashmla_mega"), Fake("flashmla"), Fake("triton"), Fake("torch")
    _install(flashmla_mega=mega, flashmla=fm, triton=tr, torch=to)
    assert B.select_backend("auto", Problem("decode_fused", 64)).name == "flashmla_mega"
    mega.ok = False
    assert B.select_backend("auto", Problem("decode", 64)).name == "flashmla"
    # few heads: FlashMLA would pad them to 64, auto prefers Triton and says why
    sel = B.select_backend("auto", Problem("decode", 8))
    assert sel.name == "triton" and "padded to 64" in sel.reason
    fm.ok = tr.ok = False
    assert B.select_backend("auto", Problem("decode", 64)).name == "torch"
    to.ok = False
    with pytest.raises(RuntimeError, match="no backend"):
        B.select_backend("auto", Problem("decode", 64))


def test_a_backend_must_serve_every_problem():
    class DecodeOnly(Fake):
        def probe(self, problem):
            return Availability(problem.kind == "decode", "decode only")

    _install(triton=DecodeOnly("triton"), flashmla=Fake("flashmla", ok=False),
             flashmla_mega=Fake("flashmla_mega", ok=False))
    sel = B.select_backend("auto", [Problem("decode", 8), Problem("prefill", 8)])
    assert sel.name == "torch"


def test_a_raising_probe_is_reported_not_fatal():
    _install(flashmla_mega=Fake("flashmla_mega", raises=True))
    a = B.probe("flashmla_mega", Problem("decode_fused", 8))
    assert not a and "boom" in a.reason
    assert B.select_backend("auto", Problem("decode", 8)).name in ("torch", "triton")


def test_env_var_overrides(monkeypatch):
    _install(triton=Fake("triton"), flashmla=Fake("flashmla"))
    monkeypatch.setenv(B.ENV_VAR, "torch")
    sel = B.select_backend("flashmla", Problem("decode", 64))
    assert sel.name == "torch" and "DSV41_BACKEND=torch overrides" in sel.reason
    monkeypatch.setenv(B.ENV_VAR, "triton")
    assert B.select_backend("auto", Problem("decode", 8)).name == "triton"
    monkeypatch.setenv(B.ENV_VAR, "flashmla_mega")
    with pytest.raises(RuntimeError, match="overrides"):
        B.select_backend("auto", Problem("decode", 8))
    monkeypatch.setenv(B.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="DSV41_BACKEND"):
        B.select_backend("auto", Problem("decode", 8))


def test_new_backend_is_one_registry_line():
    fake = Fake("mine")
    B.register_backend("mine", lambda: fake)
    assert "mine" in B.list_backends()
    assert B.select_backend("mine", Problem("decode", 8)).backend is fake
    assert "mine" not in registry.AUTO_ORDER  # joins auto only when listed there
    assert "mine says yes" in B.describe(Problem("decode", 8))


def test_malformed_problem_fields_and_names_are_named():
    """A window record only the compressed cache uses (288), a device torch cannot parse and
    a backend name that is not a str: ValueError / TypeError naming the argument."""
    for name in ("auto", "torch"):
        with pytest.raises(ValueError, match="swa_record.*288"):
            B.select_backend(name, kind="decode", num_heads=8, swa_record=288)
        with pytest.raises(ValueError, match="device.*'bogus'"):
            B.select_backend(name, kind="decode", num_heads=8, device="bogus")
    a = B.probe("torch", Problem("decode", 8, swa_record=288))
    assert not a and "swa_record" in a.reason
    assert "device" in B.probe("triton", Problem("prefill", 8, device="bogus")).reason
    for record in (584, 528):  # the window records stay valid, with any compressed record
        assert B.select_backend("torch", kind="decode", num_heads=8, swa_record=record,
                                extra_record=288).name == "torch"
    assert B.select_backend("torch", kind="decode", num_heads=8, device="cpu").name == "torch"
    for bad in (["torch"], None, 3):
        with pytest.raises(TypeError, match="^name: expected a backend name"):
            B.get_backend(bad)
    assert not B.probe(["torch"], Problem("decode", 8))
