"""The attention layer under torch.distributed: TP=2 processes (gloo on the CPU, NCCL on GPUs)
reproduce the TP=1 layer's outputs through the layer's own all-reduce.

Each rank builds the same random weights and steps (prefills of several requests, a 1-token
prompt, decodes with an idle request and CUDA-graph padding, a mixed step), runs its shard, and
rank 0 compares with an in-process TP=1 layer. The same run with the all-reduce skipped must
fail the comparison. The launcher script (``perf/tp_run.py`` under torchrun) is run end to end.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41_triton.layers.config import DeepseekV41AttentionConfig
from dsv41_triton.layers.distributed import (
    DEFAULT_STEPS,
    NCCL_ENV_DEFAULTS,
    ScenarioSetup,
    build_tp_layer,
    check_tp_against_tp1,
    init_tp_from_env,
    launch_local,
)
from dsv41_triton.layers.weights import random_attention_state_dict

CFG = DeepseekV41AttentionConfig(
    name="tiny", hidden_size=64, num_attention_heads=8, q_lora_rank=32, o_lora_rank=16,
    o_groups=4, sliding_window=8, index_topk=4, compress_ratios=(0, 1, 2),
)
ROOT = Path(__file__).resolve().parents[2]


def _worker(out_dir: str, device: str, backend: str, cfg, layer_ids, setup: ScenarioSetup,
            steps) -> None:
    """One rank: the TP check with and without the all-reduce, per layer; rank 0 writes JSON."""
    ctx = init_tp_from_env(device)
    report = {"backend": ctx.backend, "env": {k: os.environ.get(k) for k in NCCL_ENV_DEFAULTS}}
    for layer_id in layer_ids:
        kw = dict(backend=backend, setup=setup, steps=steps, weights_seed=layer_id + 1)
        good = check_tp_against_tp1(ctx, cfg, layer_id, **kw)
        bad = check_tp_against_tp1(ctx, cfg, layer_id, skip_reduce=True, **kw)
        report[str(layer_id)] = {
            "good": good.summary(), "bad": bad.summary(),
            "heads": good.layer.n_local_heads, "groups": good.layer.n_local_groups,
            "backend": good.layer.selection.name,
        }
    if ctx.is_main:
        Path(out_dir, "report.json").write_text(json.dumps(report))


def _run(tmp_path, device, backend, layer_ids, cfg=CFG, setup=None, steps=DEFAULT_STEPS):
    launch_local(_worker, 2, args=(str(tmp_path), device, backend, cfg, tuple(layer_ids),
                                   setup or ScenarioSetup(seed=3), steps))
    return json.loads((tmp_path / "report.json").read_text())


def _check_report(rep, layer_ids, backend, cfg=CFG, nsteps=len(DEFAULT_STEPS)):
    for lid in layer_ids:
        r = rep[str(lid)]
        assert (r["heads"], r["groups"], r["backend"]) == (
            cfg.num_attention_heads // 2, cfg.o_groups // 2, backend)
        good, bad = r["good"], r["bad"]
        assert len(good["rel_errs"]) == nsteps
        assert good["ok"], good
        assert good["ranks_agree"] and good["padding_zero"]
        assert good["max_rel_err"] <= 1e-2
        # without the all-reduce each rank keeps its partial sum: the check must fail
        assert not bad["ok"]
        assert bad["max_rel_err"] > 0.1 and not bad["ranks_agree"]


def test_tp2_gloo_equals_tp1_torch_backend(tmp_path):
    rep = _run(tmp_path, "cpu", "torch", (0, 1, 2))
    assert rep["backend"] == "gloo"
    _check_report(rep, (0, 1, 2), "torch")


def test_init_requires_torchrun_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_tp_from_env("cpu")


def test_build_tp_layer_shards_and_caches():
    sd = random_attention_state_dict(CFG, seed=0)
    layer = build_tp_layer(CFG, 2, sd, tp_rank=1, tp_size=4, device="cpu", backend="torch",
                           num_blocks=8, page_size=4, max_model_len=64)
    assert (layer.n_local_heads, layer.n_local_groups, layer.process_group) == (2, 1, None)
    assert torch.equal(layer.attn_sink, sd["attn_sink"][2:4])
    assert torch.equal(layer.wo_b.weight, sd["wo_b.weight"][:, 16:32])
    assert layer.swa_cache.shape[:2] == (8, 4) and layer.compressed_cache is not None
    with pytest.raises(ValueError, match="does not divide"):
        build_tp_layer(CFG, 0, sd, tp_rank=0, tp_size=3, device="cpu", backend="torch",
                       num_blocks=8, page_size=4)


def _torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def test_tp_run_script_under_torchrun(tmp_path):
    """perf/tp_run.py end to end: 2 gloo ranks, tiny preset, torch backend; JSON rows out."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "tp.jsonl"
    cmd = _torchrun() + ["--standalone", "--nproc-per-node", "2",
                         str(ROOT / "perf" / "tp_run.py"), "--tp", "2", "--preset", "tiny",
                         "--backend", "torch", "--device", "cpu", "--iters", "2",
                         "--warmup", "1", "--jsonl", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["tp"] for r in rows} == {1, 2}
    assert all(r["ok"] for r in rows if r["tp"] == 2), rows
    assert all(r["median_ms"] > 0 for r in rows)
    assert {r["phase"] for r in rows} == {"prefill", "decode"}


GPU_CFG = DeepseekV41AttentionConfig(
    name="gpu-small", hidden_size=512, num_attention_heads=16, q_lora_rank=128, o_lora_rank=64,
    o_groups=2, sliding_window=128, index_topk=64, compress_ratios=(0, 1, 2),
)
GPU_STEPS = (
    ((("C", 1), ("A", 300), ("B", 150), ("D", 90)), 0),
    ((("A", 1), ("B", 1), ("C", 1), ("D", 0)), 0),
    ((("A", 1), ("B", 1), ("C", 1)), 5),
    ((("A", 1), ("C", 1), ("D", 70), ("E", 129), ("F", 3), ("G", 2), ("H", 40)), 0),
)


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", ["tiny", "gpu-small"])
def test_tp2_nccl_equals_tp1_triton_backend(tmp_path, shapes):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    cfg, steps = (CFG, DEFAULT_STEPS) if shapes == "tiny" else (GPU_CFG, GPU_STEPS)
    setup = ScenarioSetup(seed=5, num_blocks=128, page_size=64, compressed_page_size=64,
                          blocks_per_req=8, max_model_len=1024)
    rep = _run(tmp_path, "cuda", "triton", (0, 1, 2), cfg, setup, steps)
    assert rep["backend"] == "nccl"
    assert all(v is not None for v in rep["env"].values()), rep["env"]  # set before NCCL init
    _check_report(rep, (0, 1, 2), "triton", cfg, len(steps))


def test_scenario_is_deterministic_and_topk_rows_valid():
    """Every rank rebuilds the steps from the seed: equal seeds give equal steps."""
    from dsv41_triton.layers.scenario import Scenario

    def steps(seed):
        sc = Scenario(CFG, 1, seed=seed)
        return [sc.step(list(p), pad) for p, pad in DEFAULT_STEPS]

    a, b, c = steps(7), steps(7), steps(8)
    for x, y in zip(a, b):
        assert torch.equal(x.hidden, y.hidden) and torch.equal(x.topk_indices, y.topk_indices)
        assert torch.equal(x.metadata.swa_slot_mapping, y.metadata.swa_slot_mapping)
    assert not torch.equal(a[0].hidden, c[0].hidden)
    sc = Scenario(CFG.replace(index_topk=6), 2, seed=1)
    rows = sc.topk_rows(0, 40)  # ratio 2: token at pos has (pos + 1) // 2 completed entries
    for pos in range(40):
        avail, row = (pos + 1) // 2, rows[pos]
        n = min(avail, 6)
        assert (row[n:] == -1).all()
        picked = row[:n][row[:n] >= 0]
        assert (picked < avail).all() and picked.unique().numel() == picked.numel()
    assert (rows >= 0).sum() > 0.6 * sum(min((p + 1) // 2, 6) for p in range(40))
    assert (Scenario(CFG, 0).topk_rows(0, 5) == -1).all()  # window-only layer
