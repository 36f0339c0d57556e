"""``replace_attention`` on tiny random transformers DeepSeek-V4 models (no downloads): attention
outputs and logits against transformers with its keys put through the 584-record codec (the fair
reference), one-shot and incremental (prefill then decode with the cache), ``generate()``, per
layer type (window, CSA ratio 4, HCA ratio 128)."""
import copy

import pytest
import torch

tf = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

from dsv41_triton.integrations.transformers import (  # noqa: E402
    DeepseekV41TransformersAttention,
    replace_attention,
)
from dsv41_triton.ops.records import quantize_dequantize_ref  # noqa: E402
from dsv41_triton.testing import rel_err  # noqa: E402

# transformers 5.24 renames past_key_values to cache (5.17 has only the former): keep the old
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
PROMPT, DECODE = 130, 4  # > 128 tokens: the HCA layer completes an entry in the prompt


def tiny_model(types, device, seed=0):
    """A random DeepSeek-V4 with O(1) activations: one routed expert (no routing flips to
    amplify differences), window 8, CSA top-4 of up to 35 entries (8 indexer heads: with fewer,
    many ReLU scores are exactly 0 and top-k ties break by tensor width), HCA ratio 128."""
    cfg = tf.DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(types),
        num_attention_heads=8, q_lora_rank=32, o_lora_rank=16, o_groups=4, sliding_window=8,
        index_topk=4, index_n_heads=8, index_head_dim=64, n_routed_experts=1,
        num_experts_per_tok=1, hc_mult=2, hc_sinkhorn_iters=3, layer_types=list(types),
        mlp_layer_types=["moe"] * len(types), max_position_embeddings=1024,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1},
        bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    m = tf.DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "norm" in n:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return m.to(device)


def with_fp8_keys(model):
    """transformers with every key (window and compressed) put through the 584-byte record
    codec; RoPE touches only the bf16 dims, so quantizing before it is the same."""
    def hook(mod, inp, out):
        q = quantize_dequantize_ref(out.reshape(-1, 512).to(torch.bfloat16), 584)
        return q.to(out.dtype).view_as(out)

    for n, mod in model.named_modules():
        if n.endswith(("self_attn.kv_norm", "self_attn.compressor.kv_norm")):
            mod.register_forward_hook(hook)
    return model


def record_attention(model):
    outs = []
    for n, mod in model.named_modules():
        if n.endswith("self_attn"):
            mod.register_forward_hook(lambda mod, i, o: outs.append(o[0].detach().float().cpu()))
    return outs


@torch.no_grad()
def run(model, ids):
    """One-shot logits, and prefill + DECODE single-token steps with the cache."""
    one = model(ids).logits.float().cpu()
    out = model(ids[:, :PROMPT], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    for i in range(PROMPT, ids.shape[1]):
        o = model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
        steps.append(o.logits)
    return one, torch.cat(steps, 1).float().cpu()


def _ids(device, batch=1, n=PROMPT + DECODE, seed=1):
    return torch.randint(3, 64, (batch, n), generator=torch.Generator().manual_seed(seed)).to(device)


def _backend_or_skip(backend, device):
    if backend == "auto":
        return
    from dsv41_triton.backends import Problem, probe

    a = probe(backend, Problem("decode", 8, torch.device(device), 584, 584))
    if not a.available:
        pytest.skip(f"{backend}: {a.reason}")


@pytest.mark.parametrize("backend", ["auto", pytest.param("flashmla", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layer_type", [SW, CSA, HCA], ids=["window", "csa4", "hca128"])
def test_logits_within_the_fp8_floor(layer_type, backend, device):
    _backend_or_skip(backend, device)
    m = tiny_model([layer_type], device)
    plain, ref = copy.deepcopy(m), with_fp8_keys(copy.deepcopy(m))
    a_plain, a_ref = record_attention(plain), record_attention(ref)
    p_one, p_inc = run(plain, _ids(device))
    r_one, r_inc = run(ref, _ids(device))
    assert replace_attention(m, backend=backend) is m
    assert isinstance(m.model.layers[0].self_attn, DeepseekV41TransformersAttention)
    a_ours = record_attention(m)
    o_one, o_inc = run(m, _ids(device))
    # The floor: what FP8 keys alone change. Ours computes in bf16, so its keys straddle FP8
    # rounding boundaries differently from the fp32 reference's: it stays well inside the floor
    # rather than at zero.
    for ours, fair, unquantized in ((o_one, r_one, p_one), (o_inc, r_inc, p_inc),
                                    (a_ours[0], a_ref[0], a_plain[0])):
        floor = rel_err(unquantized, fair)
        err = rel_err(ours, fair)
        assert 1e-3 < floor < 0.1, floor
        assert err <= 0.75 * floor, (err, floor)
    # decode steps one by one: every step's attention output
    steps_ours, steps_ref = torch.cat(a_ours[2:], 1), torch.cat(a_ref[2:], 1)
    assert rel_err(steps_ours, steps_ref) <= 0.75 * rel_err(torch.cat(a_plain[2:], 1), steps_ref)


def _fed_logits(model, seq):
    """Logits of ``seq[PROMPT:]`` computed as generate computes them: prefill, then one token
    a step with the cache."""
    r = model(seq[:, :PROMPT], use_cache=True)
    steps, cache = [r.logits[:, -1:]], r.past_key_values
    for i in range(PROMPT, seq.shape[1] - 1):
        steps.append(model(seq[:, i:i + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(steps, 1).float().cpu()


def test_every_attention_swapped_and_greedy_generate(device):
    # the CSA layer first: its indexer sees the same input in every run (top-k is discontinuous:
    # a later CSA layer's picks would flip under any perturbation upstream, FP8 keys included)
    m = tiny_model([CSA, HCA, SW], device)
    plain, ref = copy.deepcopy(m), with_fp8_keys(copy.deepcopy(m))
    replace_attention(m)
    mods = [mod for mod in m.modules() if type(mod).__name__ == "DeepseekV4Attention"]
    assert not mods
    swapped = [layer.self_attn for layer in m.model.layers]
    assert [s.layer.compress_ratio for s in swapped] == [4, 128, 0]
    assert [s.layer.has_indexer for s in swapped] == [True, False, False]
    ids = _ids(device, n=PROMPT)
    with torch.no_grad():
        g = m.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)
        assert g.sequences.shape == (1, PROMPT + 4)
        assert torch.equal(g.sequences[:, :PROMPT], ids)
        # each step's scores against the codec reference fed the generated sequence
        fed = [_fed_logits(x, g.sequences) for x in (ref, plain)]
    scores = torch.stack([s.float().cpu() for s in g.scores], 1)  # [1, 4, vocab]
    assert rel_err(scores, fed[0]) <= 0.75 * rel_err(fed[1], fed[0])
    assert torch.equal(g.sequences[0, PROMPT:].cpu(), scores[0].argmax(-1))


def test_batch_rows_and_stateless_calls(device):
    m = replace_attention(tiny_model([CSA], device))
    ids = _ids(device, batch=2, n=24)
    with torch.no_grad():
        both = m(ids).logits
        rows = [m(ids[b:b + 1]).logits for b in range(2)]
        stateless = m(ids, use_cache=False).logits
    assert torch.allclose(both, torch.cat(rows), atol=1e-5)
    assert torch.allclose(both, stateless, atol=1e-5)
    with torch.no_grad():  # batched decode steps: each row as if alone (to bf16 GEMM rounding)
        g2 = m.generate(ids, max_new_tokens=3, do_sample=False, output_scores=True,
                        return_dict_in_generate=True)
        g1 = [m.generate(ids[b:b + 1], max_new_tokens=3, do_sample=False, output_scores=True,
                         return_dict_in_generate=True) for b in range(2)]
    for b in range(2):
        for s2, s1 in zip(g2.scores, g1[b].scores):
            assert rel_err(s2[b], s1[0]) <= 5e-3


def test_unsupported_inputs_raise(device):
    m = replace_attention(tiny_model([SW], device))
    ids = _ids(device, n=8)
    with pytest.raises(ValueError, match="position_ids"):
        with torch.no_grad():
            m(ids, position_ids=torch.arange(3, 11, device=device)[None])
    with pytest.raises(ValueError, match="no transformers DeepseekV4Attention"):
        replace_attention(m)
