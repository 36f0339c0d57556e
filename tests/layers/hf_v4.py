"""Helpers for the tests that compare with transformers' DeepSeek-V4 modules (imported by
module name: the test directory is on ``sys.path``; its test modules are not a package)."""
from __future__ import annotations

import pytest
import torch


def hf_v4(**changes):
    """``(modeling module, tiny DeepseekV4Config)``: hidden 64, head_dim 512, 8 heads, index
    4 heads x 128, top-k 8, window 16, layers [CSA (ratio 4), HCA (ratio 128)]."""
    tf = pytest.importorskip("transformers")
    from packaging.version import Version

    if Version(tf.__version__) < Version("5.24"):
        pytest.skip(f"written against transformers 5.24's DeepSeek-V4 modules (their cache and "
                    f"compressor internals), found {tf.__version__}")
    tr = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import (
        DeepseekV4Config,
    )

    kw = {"hidden_size": 64, "head_dim": 512, "num_attention_heads": 8, "num_hidden_layers": 2,
          "q_lora_rank": 32, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 8,
          "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16, "vocab_size": 100,
          "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
          "qk_rope_head_dim": 64}
    kw.update(changes)
    return tr, DeepseekV4Config(**kw)


def hf_cos_sin_cache(rotary, max_pos, kind="compress"):
    """Our ``[max_pos, 64]`` table from a transformers rotary module's frequencies."""
    inv = getattr(rotary, f"{kind}_inv_freq").double()
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).float()
