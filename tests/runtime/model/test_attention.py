"""The two exact MLA prefill forms (runtime/model/attention.py) agree, and the rule between them."""

from __future__ import annotations

import torch

from mlac.runtime.model.attention import ABSORBED_MAX_Q_LEN, extend_absorbed, extend_mha, prefer_absorbed


def test_forms_agree_with_prefixes():
    g = torch.Generator().manual_seed(0)
    h, nope, rope, c, v = 3, 16, 8, 32, 12
    q_lens, ctx_lens = [5, 1, 9], [0, 7, 20]
    kv_lens = [q + p for q, p in zip(q_lens, ctx_lens, strict=True)]
    t, s = sum(q_lens), sum(kv_lens)
    q_nope, q_rope = torch.randn(t, h, nope + rope, generator=g).split([nope, rope], dim=-1)  # strided views
    kv = torch.randn(s, c + rope, generator=g)
    w_kc, w_vc = torch.randn(h, nope, c, generator=g) / c**0.5, torch.randn(h, c, v, generator=g) / c**0.5
    cu_q = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    cu_kv = torch.tensor([0, 5, 13, 42], dtype=torch.int32)
    args = (q_nope, q_rope, kv, w_kc, w_vc, cu_q, cu_kv, max(q_lens), 0.2)
    mha, absorbed = extend_mha(*args), extend_absorbed(*args)
    assert mha.shape == absorbed.shape == (t, h, v)
    torch.testing.assert_close(absorbed, mha, rtol=1e-5, atol=1e-5)


def test_rule_weights_new_tokens_by_cache_length():
    assert prefer_absorbed([1], [10_000])  # one new token on a long cache
    assert prefer_absorbed([4, 4], [4096, 100])
    assert not prefer_absorbed([4096], [0])  # a long fresh prompt
    assert prefer_absorbed([ABSORBED_MAX_Q_LEN], [0])
    assert not prefer_absorbed([ABSORBED_MAX_Q_LEN + 1], [0])
    # a long prompt beside short continuations: its pairs dominate
    assert not prefer_absorbed([2048, 1, 1], [0, 500, 500])
