"""benchmarks/kernels/mla_peers.py: FlashInfer's view of mlac's paged pool holds the same tokens in the same
order, the bytes a call must read are the bytes of its inputs, rows past the memory budget are left out,
and mlac is timed with the split count and merge that decode_absorbed uses. CPU, small shapes; the GPU
test compares FlashInfer itself where it is installed."""

from __future__ import annotations

import pytest
import torch
from _paths import REPO, load_script

from mlac.kernels.attention.mla_decode import gather_kv_ref, mla_decode_ref
from mlac.runtime.model import attention as model_attention

LENS = [1, 15, 16, 17, 300, 64]  # a single token, page edges, a partial page


@pytest.fixture(scope="module")
def mp():
    return load_script(REPO / "benchmarks" / "kernels" / "mla_peers.py")


@pytest.mark.parametrize("page", [1, 16, 64])
def test_flashinfer_pages_hold_each_sequence_in_order(mp, page):
    """Gathering FlashInfer's ckv/kpe views of the pool through kv_indptr/kv_indices gives, per
    sequence, exactly the tokens that mlac's block table points at, in order (mlac's gather)."""
    inp = mp.decode_inputs(LENS, 4, page, 512, "cpu", seed=3)
    indptr, indices, kv_len = mp.flashinfer_pages(inp["table"], inp["seq_lens"], page)
    assert indptr.dtype == indices.dtype == kv_len.dtype == torch.int32
    assert indptr.tolist() == [0, *torch.tensor([-(-n // page) for n in LENS]).cumsum(0).tolist()]
    ckv, kpe = inp["kv"][..., : mp.C], inp["kv"][..., mp.C :]  # views, as the peer is given them
    direct = gather_kv_ref(inp["kv"], inp["table"], None)  # [B, W * page, C + R] float32
    for b, n in enumerate(LENS):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        got = torch.cat([ckv[pages].flatten(0, 1), kpe[pages].flatten(0, 1)], dim=-1)[:n]
        assert kv_len[b] == n and torch.equal(got.float(), direct[b, :n])


def test_attention_through_flashinfer_layout_is_mla_decode(mp):
    """Attention read through the converted layout equals mla_decode_ref over mlac's table (up to
    the bf16 rounding of the output): a page out of order or a wrong length would not."""
    inp = mp.decode_inputs(LENS, 16, 16, 1024, "cpu", seed=4)
    layout = mp.flashinfer_pages(inp["table"], inp["seq_lens"], 16)
    ckv, kpe = inp["kv"][..., : mp.C], inp["kv"][..., mp.C :]
    got = mp.paged_ref(inp["q_lat"], inp["q_rope"], ckv, kpe, *layout, mp.SCALE)
    ref, _ = mla_decode_ref(inp["q_lat"], inp["q_rope"], inp["kv"], inp["table"], inp["seq_lens"], mp.SCALE)
    assert mp.max_err(got, ref) <= 4e-3


@pytest.mark.parametrize(("heads", "batch", "context"), [(16, 1, 1024), (128, 3, 64), (16, 4, 96)])
def test_call_bytes_are_the_bytes_of_the_inputs(mp, heads, batch, context):
    """call_bytes counts each sequence's cached rows and the queries: the bytes of the tensors the
    benchmark builds (the pool's rows that seq_lens cover, q_lat and q_rope)."""
    inp = mp.decode_inputs([context] * batch, heads, 16, 2048, "cpu")
    row = inp["kv"].shape[-1] * inp["kv"].element_size()
    queries = sum(inp[k].numel() * inp[k].element_size() for k in ("q_lat", "q_rope"))
    assert mp.call_bytes(batch, heads, context) == int(inp["seq_lens"].sum()) * row + queries


def test_rows_past_the_memory_budget_are_left_out(mp):
    """At 8 GiB the 256 x 32k rows (a 9.7 GB pool) are skipped and 256 x 8k (2.4 GB) kept; at 32 GiB
    every row runs; each bound covers the pool the row allocates."""
    rows, skipped = mp.cases(mp.BATCHES, mp.CONTEXTS, 16, 8.0)
    assert {(b, c) for _, _, b, c in skipped} == {(256, 32768)}
    assert ("v3", 128, 256, 8192) in rows
    assert mp.cases(mp.BATCHES, mp.CONTEXTS, 16, 32.0)[1] == []
    inp = mp.decode_inputs([100] * 3, 16, 16, 512, "cpu")
    assert mp.peak_bytes(3, 16, 100, 16) >= inp["kv"].numel() * inp["kv"].element_size()


def test_mlac_is_timed_as_decode_absorbed_calls_it(mp, monkeypatch):
    """The split count and merge that mlac_calls times are those decode_absorbed passes to
    mla_decode for the same inputs (a table as wide as a CUDA graph's)."""
    seen = {}

    def recording(q_lat, *args, **kwargs):
        seen.update(kwargs)
        return torch.zeros_like(q_lat)

    monkeypatch.setattr(model_attention, "mla_decode", recording)
    inp = mp.decode_inputs([40, 100, 7], 16, 16, 2048, "cpu")  # 8 splits at this width, 2 at 128 tokens
    w_kc = torch.randn(16, 128, mp.C).bfloat16()
    w_vc = torch.randn(16, mp.C, 128).bfloat16()
    q_nope = torch.randn(3, 16, 128).bfloat16()
    model_attention.decode_absorbed(
        q_nope, inp["q_rope"], inp["kv"], inp["table"], inp["seq_lens"], mp.SCALE, None, w_kc, w_vc
    )
    merged, unmerged, splits = mp.mlac_calls(inp)
    assert splits > 1 and merged.keywords["num_splits"] == seen["num_splits"] == splits
    assert (unmerged is not None) == (seen["merge"] is False)
    assert merged.keywords.get("merge", True) and unmerged.keywords["merge"] is False


@pytest.mark.gpu
def test_flashinfer_matches_the_reference_on_gpu(mp):
    """Where flashinfer is installed: its MLA decode (fa2) over mlac's pool against mla_decode_ref."""
    pytest.importorskip("flashinfer")
    workspace = torch.empty(mp.WORKSPACE, dtype=torch.uint8, device="cuda")
    for shape, rec in mp.check(16, ["fa2"], workspace, quiet=True).items():
        assert rec["mlac_vs_ref"] < 0.05 and rec["fa2_vs_ref"] < 0.05, (shape, rec)
