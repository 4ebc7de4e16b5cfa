"""kernels/attention/flashinfer_mla.py on CPU: mlac's block tables as FlashInfer's paged layout
(page_layout) against a direct gather of each row's tokens, blocks shared between rows included;
paged_mla_ref, read through that layout, against mla_decode_ref over the block tables; the
workspace's module listing that `prepare` stores. On a GPU with flashinfer: the kernel itself against
paged_mla_ref and mla_decode over mlac's tables (the model's: tests/runtime/worker/
test_attention_backend_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from mlac.core.errors import MlacError
from mlac.kernels.attention.flashinfer_mla import page_layout, paged_mla_ref, workspace_modules
from mlac.kernels.attention.mla_decode import mla_decode_ref

PAGE, C, R, H = 4, 16, 8, 3
SCALE = 0.3


def pool_of(blocks: int, seed: int = 0) -> torch.Tensor:
    """A random pool [blocks, PAGE, C + R] whose block 0 is NaN: a row that read a padding entry
    (block 0 of mlac's padded tables) would turn NaN."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(blocks, PAGE, C + R, generator=gen)
    pool[0] = float("nan")
    return pool


# rows: two sharing a cached 2-block prefix (blocks 3, 5) then their own blocks, one of its own with a
# partial page, one of one token; the table padded with block 0 to the widest row, and wider still
TABLES = [[3, 5, 7, 0, 0, 0], [3, 5, 2, 6, 0, 0], [4, 0, 0, 0, 0, 0], [1, 8, 0, 0, 0, 0]]
LENS = [9, 14, 3, 5]


def gathered(pool: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """Row's tokens as mlac's slots give them: token p at slot table[p // PAGE] * PAGE + p % PAGE."""
    slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(n)])
    return pool.view(-1, C + R)[slots]


def through_layout(pool, indptr, indices, kv_len, b: int) -> torch.Tensor:
    """Row b's tokens as FlashInfer's kernels read them: page indices[indptr[b] + p // PAGE], p < kv_len[b]."""
    n = int(kv_len[b])
    pages = [int(indices[int(indptr[b]) + p // PAGE]) for p in range(n)]
    return torch.stack([pool[pages[p], p % PAGE] for p in range(n)])


def test_page_layout_reads_every_row_as_its_block_table_does():
    pool = pool_of(9)
    tables = torch.tensor(TABLES, dtype=torch.int32)
    indptr, indices, kv_len = page_layout(tables, LENS)
    assert indptr.tolist() == [0, 6, 12, 18, 24]  # row b's page slots start at b * W
    assert kv_len.tolist() == LENS and indices.data_ptr() == tables.data_ptr()  # a view: no copy
    for b, (table, n) in enumerate(zip(TABLES, LENS, strict=True)):
        got = through_layout(pool, indptr, indices, kv_len, b)
        assert torch.equal(got, gathered(pool, table, n)), b
        assert not got.isnan().any()  # no padding entry was read
    # the shared prefix: both sharers read the same pool rows for their first 8 tokens
    first, second = (
        through_layout(pool, indptr, indices, kv_len, 0),
        through_layout(pool, indptr, indices, kv_len, 1),
    )
    assert torch.equal(first[:8], second[:8]) and not torch.equal(first[8], second[8])


def test_page_layout_of_a_strided_table_slice_copies_it_once():
    """The CUDA graphs' static table [max_bs, max_blocks] sliced to the step's rows and width."""
    buffer = torch.zeros(8, 10, dtype=torch.int32)
    buffer[:4, :6] = torch.tensor(TABLES, dtype=torch.int32)
    indptr, indices, _ = page_layout(buffer[:4, :6], LENS)
    assert indptr.tolist() == [0, 6, 12, 18, 24] and indices.tolist() == sum(TABLES, [])


def test_page_layout_refuses_what_it_cannot_lay_out():
    with pytest.raises(MlacError, match=r"tables must be \[B, W\] int32"):
        page_layout(torch.tensor(TABLES), LENS)  # int64
    with pytest.raises(MlacError, match="3 lengths for 4 rows"):
        page_layout(torch.tensor(TABLES, dtype=torch.int32), LENS[:3])
    with pytest.raises(MlacError, match="each >= 1"):
        page_layout(torch.tensor(TABLES, dtype=torch.int32), [9, 14, 0, 5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_reference_through_the_layout_is_mla_decode_ref(dtype):
    pool = pool_of(9, seed=1).to(dtype)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(LENS), H, C + R, generator=gen).to(dtype)
    q_lat, q_rope = q[..., :C], q[..., C:]  # strided views, as the model's q_rope is
    tables = torch.tensor(TABLES, dtype=torch.int32)
    got = paged_mla_ref(q_lat, q_rope, pool, *page_layout(tables, LENS), SCALE)
    clean = pool.clone()
    clean[0] = 0  # mla_decode_ref masks the scores past a row's end, not the NaN values they multiply
    want, _ = mla_decode_ref(q_lat, q_rope, clean, tables, torch.tensor(LENS, dtype=torch.int32), SCALE)
    assert got.dtype == dtype and got.shape == (len(LENS), H, C)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_workspace_modules_are_the_built_libraries_alone(tmp_path):
    """What `prepare` stores of FlashInfer's JIT workspace: each module's library, not its objects,
    build file, generated sources or log."""
    ops = tmp_path / ".cache" / "flashinfer" / "0.6.11" / "90a" / "cached_ops"
    name = "batch_mla_attention_dtype_q_bf16_sm90"
    (ops / name).mkdir(parents=True)
    for f in (f"{name}.so", "build.ninja", "batch_mla_run.cuda.o", ".ninja_log"):
        (ops / name / f).write_bytes(b"x")
    (ops / "tmp").mkdir()
    (ops / "tmp" / "other.so").write_bytes(b"x")  # not <name>/<name>.so
    (ops.parent / "generated" / name).mkdir(parents=True)
    (ops.parent / "generated" / name / "batch_mla_run.cu").write_text("//")
    (ops.parent / "flashinfer_jit.log").write_text("")
    assert workspace_modules(tmp_path) == [f".cache/flashinfer/0.6.11/90a/cached_ops/{name}/{name}.so"]


# ---- on a GPU with flashinfer: the kernel itself against its reference --------------------------

GPU_PAGE, GPU_C, GPU_R, GPU_H = 16, 512, 64, 16  # mlac's block size; DeepSeek's latents; V2-Lite's heads
# (tables, lengths): tight rows; padded wider than used; a cached prefix shared by two rows (the
# runtime's decode steps over it, step by step, as the backend's GPU test runs them); lengths at page ends
GPU_STEPS = {
    "tight": ([[1, 2, 3], [4, 5, 6]], [41, 36]),
    "padded": ([[1, 2, 3, 0, 0, 0], [4, 0, 0, 0, 0, 0], [7, 8, 0, 0, 0, 0]], [40, 1, 17]),
    "shared": ([[1, 2, 3, 5], [1, 2, 4, 6]], [41, 36]),
    "shared-late": ([[1, 2, 3, 5], [1, 2, 4, 6]], [49, 44]),
    "page-ends": ([[1, 2, 9], [3, 11, 0], [1, 2, 10]], [32, 16, 48]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_STEPS))
@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "graph-buffers"])
def test_gpu_paged_mla_is_its_reference_over_mlac_tables(case, graph_mode):
    """PagedMLA (FlashInfer's kernel) against paged_mla_ref and mla_decode over the same pool and
    tables: block 0 NaN (a read of a padding entry shows), two layers' pools under one plan, and the
    next plan's rows right after. Where this passes and a model test fails, the wiring is at fault."""
    pytest.importorskip("flashinfer")
    from mlac.kernels.attention.flashinfer_mla import PagedMLA
    from mlac.kernels.attention.mla_decode import mla_decode

    dev, dtype, scale = torch.device("cuda"), torch.bfloat16, 0.1
    gen = torch.Generator(device=dev).manual_seed(0)
    pools = [torch.randn(12, GPU_PAGE, GPU_C + GPU_R, device=dev, generator=gen).to(dtype) for _ in range(2)]
    for p in pools:
        p[0] = float("nan")
    table_rows, lens = GPU_STEPS[case]
    tables = torch.tensor(table_rows, dtype=torch.int32, device=dev)
    b = len(lens)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    shape = dict(heads=GPU_H, kv_lora=GPU_C, rope=GPU_R, page=GPU_PAGE, scale=scale, dtype=dtype)
    indices = torch.zeros(b * 8, dtype=torch.int32, device=dev) if graph_mode else None
    mla = PagedMLA(workspace, **shape, rows=b if graph_mode else None, indices=indices)
    for step in range(2):  # the second plan right after the first's runs: no stale schedule
        mla.plan(tables, lens)
        q = torch.randn(b, GPU_H, GPU_C + GPU_R, device=dev, generator=gen).to(dtype)
        q_lat, q_rope = q[..., :GPU_C].contiguous(), q[..., GPU_C:].contiguous()
        for layer, pool in enumerate(pools):
            got = mla.run(q_lat, q_rope, pool).float()
            want = paged_mla_ref(q_lat, q_rope, pool, *page_layout(tables, lens), scale).float()
            assert not got.isnan().any(), (case, step, layer)
            err = float((got - want).norm() / want.norm())
            assert err < 2e-2, (case, step, layer, err)
            clean = pool.clone()
            clean[0] = 0
            ours = mla_decode(
                q_lat, q_rope, clean, tables, torch.tensor(lens, dtype=torch.int32, device=dev), scale
            )
            assert float((ours.float() - want).norm() / want.norm()) < 2e-2, (case, step, layer)
        lens = [min(n + 1, tables.shape[1] * GPU_PAGE) for n in lens]  # the next decode step
