"""The README's layer example runs as written (on the CPU here; on the GPU when there is one)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(marker: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- readme-example: {marker} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README has no example marked {marker!r}"
    return m.group(1)


def test_readme_layer_example_runs(capsys):
    code = _block("layer")
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    y, layer = scope["y"], scope["layer"]
    assert tuple(y.shape) == (1, layer.config.hidden_size)
    assert bool(y.isfinite().all()) and float(y.float().abs().sum()) > 0
    assert layer.compress_ratio > 0  # the example exercises the compressed cache too
    out = capsys.readouterr().out
    assert f"{layer.selection.name} (1, {layer.config.hidden_size}) True" in out
