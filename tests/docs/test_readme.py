"""The README's Python examples run as written (in order, one namespace), and the package's
top-level names resolve."""
import re
from pathlib import Path

import pytest

import dsv41_triton

ROOT = Path(__file__).resolve().parents[2]
SKIP_LINE = "# not run by the tests"


def python_blocks(text: str):
    """The ```python blocks of a Markdown text, without those whose first line is SKIP_LINE."""
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return [b for b in blocks if not b.lstrip().startswith(SKIP_LINE)]


def test_python_blocks_are_found():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\n# not run by the tests\ny\n```\n"
    assert python_blocks(text) == ["x = 1\n"]


def test_readme_examples_run():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    ns: dict = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"README.md python block {i}", "exec"), ns)
        except Exception as e:  # say which block failed
            pytest.fail(f"README python block {i} raised {type(e).__name__}: {e}\n{code}")
    # the first example's promises: shapes, and +inf lse for the token without keys
    out, lse = ns["out"], ns["lse"]
    assert out.shape == (3, 8, 512) and bool((lse[2] == float("inf")).all())
    assert bool(out[:2].float().isfinite().all()) and bool((out[2] == 0).all())
    # the backend example gives the same answer within SPEC §7
    from dsv41_triton.testing import max_abs_err, rel_err

    assert rel_err(ns["out2"][:2], out[:2]) <= 1e-2
    assert max_abs_err(ns["lse2"][:2], lse[:2]) <= 1e-3


def test_top_level_names_resolve():
    for name in dsv41_triton.__all__:
        assert getattr(dsv41_triton, name) is not None, name
    assert "allocate_k_cache" in dsv41_triton.__all__  # the README's first example needs it
    with pytest.raises(AttributeError):
        dsv41_triton.no_such_name
