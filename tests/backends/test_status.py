"""backend_status(): every backend, per kind, on this machine's default device."""

from dsv41_triton import backends as B
from dsv41_triton.backends.registry import default_device, format_backend_status


def test_backend_status_lists_every_backend_with_its_probes():
    rows = B.backend_status()
    assert [r.name for r in rows] == B.list_backends()
    dev = default_device()
    for r in rows:
        assert set(r.kinds) == set(B.KINDS)
        for kind, a in r.kinds.items():
            want = B.probe(r.name, B.Problem(kind=kind, num_heads=64, device=dev))
            assert a == want
        assert r.available == any(a.available for a in r.kinds.values())
        assert r.reason and r.name + ":" not in r.reason  # the name is not repeated
    torch_row = next(r for r in rows if r.name == "torch")
    assert torch_row.available and torch_row.auto


def test_backend_status_table_has_one_line_per_backend():
    table = format_backend_status().splitlines()
    assert table[0].split()[:6] == ["backend", *B.KINDS, "auto"]
    assert [ln.split()[0] for ln in table[1:]] == B.list_backends()
