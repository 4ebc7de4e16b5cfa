"""The loader's one pass over the bytes: every dtype, views of one allocation per file, unaligned
offsets, hashes and sizes, short reads, several threads (readpass.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from _hf_convert import raw_config, write_artifact
from safetensors import safe_open

from mlac.core.artifact import IDENTITY, artifact_identity, identity_record
from mlac.core.errors import MlacError
from mlac.core.safetensors_io import DATA_ALIGN, SafetensorsFile
from mlac.runtime.worker import readpass
from mlac.runtime.worker.loader import VIEW_ALIGN, load_artifact, start_load, to_compute_dtype

RAW = raw_config("v3", num_hidden_layers=2)
RANK = "rank-00000-of-00001"
NAMES = {  # the safetensors dtype names of the header
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file with tensors packed back to back in name order (no alignment, as mlac's
    writer does): a tensor after an odd-sized one starts at an offset its itemsize does not divide."""
    header, data = {}, b""
    for name, t in sorted(tensors.items()):
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    head = json.dumps(header).encode()
    head += b" " * (-(8 + len(head)) % 16)  # data 16-byte aligned, then tensors back to back
    return struct.pack("<Q", len(head)) + head + data


def make_artifact(root: Path, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    """A 1-rank artifact whose rank folder holds `files` (file name -> tensors), packed by `pack`."""
    write_artifact(root, RAW, {"embed": torch.zeros(1)}, None)  # a valid manifest to start from
    (root / RANK / "embed.safetensors").unlink()
    m = json.loads((root / "manifest.json").read_text())
    m["tensors"], m["files"] = [{}], []
    for fname, tensors in sorted(files.items()):
        data = pack(tensors)
        (root / RANK / fname).write_bytes(data)
        rel = f"{RANK}/{fname}"
        m["files"].append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        for name, t in tensors.items():
            m["tensors"][0][name] = {"file": rel, "dtype": NAMES[t.dtype], "shape": list(t.shape)}
    (root / "manifest.json").write_text(json.dumps(m))
    (root / IDENTITY).write_text(identity_record(artifact_identity(root)))
    return root


def every_dtype(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(5, 3, generator=g)
    return {
        "0.u8x16": torch.arange(16, dtype=torch.uint8),  # at offset 0: aligned, and so is what follows
        "a.odd_bf16": f[0].to(torch.bfloat16),  # 6 bytes: what follows is unaligned
        "b.f32": f,
        "c.odd_fp8": f[:, 0].to(torch.float8_e4m3fn),  # 5 bytes
        "d.i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "e.fp8_e5m2": f.to(torch.float8_e5m2),
        "f.i32": torch.randint(-1000, 1000, (3,), generator=g, dtype=torch.int32),
        "g.f16": f.to(torch.float16),
        "h.bool": f[0] > 0,
        "i.f64": f.to(torch.float64),
        "j.i16": torch.arange(-3, 4, dtype=torch.int16),
        "k.i8": torch.arange(-3, 4, dtype=torch.int8),
        "l.u8": torch.arange(250, 256, dtype=torch.uint8),
        "m.scalar": torch.tensor(2.5),
        "n.empty": torch.zeros(0, 3),
        "o.scale": torch.rand(2, 2, generator=g),  # float32 whatever the compute dtype
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    files = {f"part-{i}.safetensors": {f"p{i}.{k}": t for k, t in every_dtype(i).items()} for i in range(3)}
    files["big.safetensors"] = {
        "big.w": torch.randn(64, 1000),
        "big.u": torch.randn(76),
    }  # 256 kB, both aligned
    return make_artifact(tmp_path_factory.mktemp("art") / "a", files)


@pytest.fixture
def art(tmp_path, pristine) -> Path:
    """A fresh copy to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "a"))


def reference(root: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted((root / RANK).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out.update({k: to_compute_dtype(k, f.get_tensor(k), dtype) for k in f.keys()})
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (t.dtype, t.shape), name
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name  # bitwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_dtype_equals_safe_open(pristine, dtype):
    assert_same(load_artifact(pristine, dtype=dtype).tensors, reference(pristine, dtype))


def test_a_compiled_fp8_artifact_equals_safe_open(artifact):
    root = artifact("tiny-v3", fp8=True)
    loaded = load_artifact(root, dtype=torch.bfloat16).tensors
    assert {t.dtype for t in loaded.values()} >= {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    assert_same(loaded, reference(root, torch.bfloat16))


def starts(root: Path, fname: str) -> dict[str, int]:
    """Each tensor's absolute byte offset in the rank file `fname`."""
    return {n: i.start for n, i in SafetensorsFile(root / RANK / fname).tensors.items()}


def test_the_tensors_of_one_file_are_views_of_one_allocation(pristine):
    tensors = load_artifact(pristine, dtype=torch.float32).tensors
    ptr = lambda name: tensors[name].untyped_storage().data_ptr()  # noqa: E731
    for i in range(3):
        at = starts(pristine, f"part-{i}.safetensors")
        stored = every_dtype(i)
        aligned = [f"p{i}.{k}" for k, t in stored.items() if at[f"p{i}.{k}"] % VIEW_ALIGN == 0 and t.numel()
                   and tensors[f"p{i}.{k}"].dtype == t.dtype]  # fmt: skip
        assert aligned and len({ptr(n) for n in aligned}) == 1, "aligned, uncast: views of the file's bytes"
        assert ptr(f"p{i}.a.odd_bf16") not in {ptr(n) for n in aligned}  # cast to float32: a new tensor
    assert ptr("p0.k.i8") != ptr("p1.k.i8")  # one allocation per file
    assert ptr("big.u") == ptr("big.w")


def test_a_tensor_at_an_unaligned_offset_is_copied_out(pristine):
    tensors = load_artifact(pristine, dtype=torch.bfloat16).tensors
    at = starts(pristine, "part-0.safetensors")
    base = tensors["p0.a.odd_bf16"].untyped_storage().data_ptr()  # at the first offset: a view
    assert at["p0.a.odd_bf16"] % VIEW_ALIGN == 0
    for name in ("p0.b.f32", "p0.c.odd_fp8"):  # after the 6-byte tensor: unaligned, copied out
        assert at[name] % VIEW_ALIGN != 0
        assert tensors[name].untyped_storage().data_ptr() != base
        assert tensors[name].data_ptr() % VIEW_ALIGN == 0
    for name, t in tensors.items():  # every tensor the loader hands out is aligned
        assert t.data_ptr() % VIEW_ALIGN == 0 or t.numel() == 0, name


def test_mlacs_writer_aligns_every_tensor_of_an_aligned_size(artifact):
    """The data starts DATA_ALIGN-aligned and tensors of aligned sizes come first: all views."""
    root = artifact("tiny-v3", fp8=True)
    for f in (root / RANK).glob("*.safetensors"):
        infos = SafetensorsFile(f).tensors.values()
        assert all(i.start % DATA_ALIGN == 0 for i in infos if i.nbytes % DATA_ALIGN == 0), f.name


def test_load_stats_count_the_bytes_read(pristine):
    sizes = [p.stat().st_size for p in (pristine / RANK).glob("*.safetensors")]
    stats = load_artifact(pristine, threads=3).stats
    assert (stats.bytes, stats.threads, stats.verified) == (sum(sizes), 3, True)
    assert stats.seconds > 0 and stats.gb_per_s == pytest.approx(stats.bytes / 1e9 / stats.seconds)
    assert str(stats).startswith(f"verify+load: {stats.bytes / 1e9:.3g} GB in {stats.seconds:.3g} s")
    assert not load_artifact(pristine, verify=False).stats.verified


def test_a_tampered_byte_is_refused_with_verify_and_loaded_without(art):
    path = art / RANK / "part-1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte of p1.o.scale (same size, different bytes)
    path.write_bytes(bytes(data))
    for threads in (1, 4):
        with pytest.raises(MlacError, match="part-1.safetensors: sha256 does not match the manifest"):
            load_artifact(art, threads=threads)
    loaded = load_artifact(art, verify=False).tensors  # sizes only: the flipped byte is not seen
    assert not torch.equal(loaded["p1.o.scale"], every_dtype(1)["o.scale"])


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_file_is_refused_in_both_modes(art, verify):
    path = art / RANK / "big.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(MlacError, match="big.safetensors: size"):
        load_artifact(art, verify=verify)


@pytest.mark.parametrize("verify", [True, False])
def test_a_file_that_shrinks_while_it_is_read_is_refused(pristine, monkeypatch, verify):
    real = os.preadv

    def eof_after_8k(fd, bufs, offset):
        return 0 if offset >= 8192 else real(fd, [bufs[0][: 8192 - offset]], offset)

    monkeypatch.setattr(readpass.os, "preadv", eof_after_8k)
    with pytest.raises(MlacError, match=r"big.safetensors: truncated while reading \(at byte 8192\)"):
        load_artifact(pristine, verify=verify)


def test_short_reads_still_load_every_byte(pristine, monkeypatch):
    real, calls = os.preadv, []

    def at_most_999_bytes(fd, bufs, offset):
        calls.append(offset)
        return real(fd, [bufs[0][:999]], offset)

    monkeypatch.setattr(readpass.os, "preadv", at_most_999_bytes)
    monkeypatch.setattr(readpass, "CHUNK", 10_000)  # several chunks per file, each in several reads
    assert_same(load_artifact(pristine, dtype=torch.float32).tensors, reference(pristine, torch.float32))
    assert len(calls) > 250  # ~260 kB in reads of 999 bytes


def test_several_threads_give_what_one_gives(pristine, monkeypatch):
    monkeypatch.setattr(readpass, "CHUNK", 4096)
    one = load_artifact(pristine, dtype=torch.float32, threads=1).tensors
    assert_same(load_artifact(pristine, dtype=torch.float32, threads=4).tensors, one)


def test_a_tampered_file_that_holds_no_tensors_is_refused(artifact, tmp_path):
    root = Path(shutil.copytree(artifact("tiny-v3"), tmp_path / "a"))
    tok = root / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes().replace(b"{", b" ", 1))  # same size
    with pytest.raises(MlacError, match="tokenizer/tokenizer.json: sha256 does not match"):
        load_artifact(root)
    load_artifact(root, verify=False)  # not read at all without hashing


def allocations(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """The tensors' names grouped by the allocation they view (a derived tensor: alone; empty
    tensors left out, their storages may have no address)."""
    groups: dict[int, list[str]] = {}
    for name, t in sorted(tensors.items()):
        if t.numel():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return sorted(groups.values())


def test_a_cast_tensor_is_an_allocation_of_its_own(pristine):
    # big.w and big.u are stored float32: views of the file's bytes in float32, cast (derived) in bf16
    fp32 = allocations(load_artifact(pristine, dtype=torch.float32).tensors)
    bf16 = allocations(load_artifact(pristine, dtype=torch.bfloat16).tensors)
    assert ["big.u", "big.w"] in fp32
    assert ["big.u"] in bf16 and ["big.w"] in bf16
    assert [
        "p0.0.u8x16",
        "p0.a.odd_bf16",
        "p0.h.bool",
        "p0.l.u8",
    ] in bf16  # uncast, aligned: views of the file
    assert allocations(start_load(pristine, dtype=torch.bfloat16).join().tensors) == bf16  # the same plan


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_load_through_pinned_staging_equals_the_cpu_load(pristine, monkeypatch, dtype):
    monkeypatch.setattr(readpass, "CHUNK", 4096)  # many staged copies per file, both buffers reused
    cpu = load_artifact(pristine, dtype=dtype).tensors
    gpu = load_artifact(pristine, device="cuda", dtype=dtype, threads=3).tensors
    assert {t.device.type for t in gpu.values()} == {"cuda"}
    assert_same({k: t.cpu() for k, t in gpu.items()}, cpu)
    assert allocations(gpu) == allocations(cpu)  # one device allocation per file, the same views of it
