"""Files hashed in pieces (FileEntry.pieces): the writer hashes them as it writes, the read pass
reads, hashes and places one file's pieces on several threads, a bad piece is refused by name,
and manifests without pieces (schema_version 1) still load and verify."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from test_loader_pass import RANK, assert_same, every_dtype, make_artifact, reference

from mlac.compiler.writer import ArtifactWriter
from mlac.core import files as core_files
from mlac.core.artifact import IDENTITY, Manifest, artifact_identity, identity_record
from mlac.core.errors import MlacError
from mlac.core.files import FileEntry, verify_files
from mlac.core.hashing import PieceHash, hash_file
from mlac.core.lazy import LazyTensor
from mlac.core.safetensors_io import WriteSpec, write_safetensors_lockstep
from mlac.runtime.worker import readpass
from mlac.runtime.worker.loader import load_artifact, start_load

PIECE = 1000  # bytes: big.safetensors (~256 kB) has ~260 pieces, the last one shorter


def piece_hashes(data: bytes, piece: int) -> list[str]:
    return [hashlib.sha256(data[i : i + piece]).hexdigest() for i in range(0, len(data), piece)]


def with_pieces(root: Path, piece: int = PIECE, version: int = 2) -> Path:
    """Rewrite the manifest: every file longer than `piece` gets its piece hashes (schema 2)."""
    m = json.loads((root / "manifest.json").read_text())
    m["schema_version"] = version
    if version < 3:
        m.pop("provenance", None)  # schema 3 added it
    for f in m["files"]:
        data = (root / f["path"]).read_bytes()
        if len(data) > piece:
            f["pieces"] = {"size": piece, "sha256": piece_hashes(data, piece)}
    (root / "manifest.json").write_text(json.dumps(m))
    (root / IDENTITY).write_text(identity_record(artifact_identity(root)))
    return root


def without_pieces(root: Path) -> Path:
    """The manifest as an mlac before piece hashes wrote it: schema_version 1, no `pieces` key."""
    m = json.loads((root / "manifest.json").read_text())
    m["schema_version"] = 1
    m.pop("provenance", None)  # schema 3 added it
    for f in m["files"]:
        f.pop("pieces", None)
    (root / "manifest.json").write_text(json.dumps(m))
    (root / IDENTITY).write_text(identity_record(artifact_identity(root)))
    return root


@pytest.fixture(scope="module")
def pieced(tmp_path_factory) -> Path:
    files = {f"part-{i}.safetensors": {f"p{i}.{k}": t for k, t in every_dtype(i).items()} for i in range(2)}
    files["big.safetensors"] = {"big.w": torch.randn(64, 1000), "big.u": torch.randn(77)}  # odd size
    root = make_artifact(tmp_path_factory.mktemp("pieces") / "a", files)
    return with_pieces(root)


@pytest.fixture
def art(tmp_path, pieced) -> Path:
    """A fresh copy to damage."""
    return Path(shutil.copytree(pieced, tmp_path / "a"))


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# -- hashing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 2000, 4567])
def test_piece_hashes_equal_the_hash_of_each_slice(size, tmp_path):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    data = data.numpy().tobytes()
    want = piece_hashes(data, PIECE) if size > PIECE else []
    h = PieceHash(PIECE)
    for i in range(0, size, 333):  # chunks that straddle piece boundaries
        h.update(data[i : i + 333])
    assert (h.size, h.pieces()) == (size, want)
    (tmp_path / "f").write_bytes(data)
    got = hash_file(tmp_path / "f", PIECE, chunk=777)
    assert (got.size, got.sha256, got.piece, got.pieces) == (
        size,
        hashlib.sha256(data).hexdigest(),
        PIECE,
        want,
    )


def test_the_writer_hashes_pieces_as_it_writes(tmp_path):
    """write_group and copy_file list each file's size, whole sha256 and piece hashes of its bytes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "small.txt").write_bytes(b"x" * PIECE)  # one piece exactly: checked whole
    (src / "big.txt").write_bytes(bytes(range(256)) * 9)  # 2304 bytes: 3 pieces
    g = torch.Generator().manual_seed(0)
    ranks = [{"w": torch.randn(70, 9, generator=g), "b": torch.randn(3, generator=g)} for _ in range(2)]
    lazy = [{n: LazyTensor(tuple(t.shape), t.dtype, lambda t=t: t) for n, t in r.items()} for r in ranks]
    with ArtifactWriter(tmp_path / "out", world_size=2, source=src, piece=PIECE) as w:
        w.write_group("layer-00000.safetensors", lazy)
        w.copy_file(src / "small.txt", "tokenizer/small.txt")
        w.copy_file(src / "big.txt", "tokenizer/big.txt")
        for entry in w.files:
            data = (w.root / entry.path).read_bytes()
            assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest()), entry.path
            want = piece_hashes(data, PIECE) if len(data) > PIECE else None
            assert (entry.pieces and entry.pieces.sha256) == want, entry.path
            assert entry.pieces is None or entry.pieces.size == PIECE
    assert [e.pieces is not None for e in w.files] == [True, True, False, True]


def test_lockstep_writer_returns_the_hashes_of_what_it_wrote(tmp_path):
    t = torch.arange(1000, dtype=torch.int32)
    spec = WriteSpec("t", t.dtype, tuple(t.shape), t.split(77))
    (h,) = write_safetensors_lockstep([tmp_path / "f.safetensors"], [[spec]], piece=512)
    data = (tmp_path / "f.safetensors").read_bytes()
    assert FileEntry.of("f", h) == FileEntry.model_validate(
        {"path": "f", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
         "pieces": {"size": 512, "sha256": piece_hashes(data, 512)}}
    )  # fmt: skip


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_is_one_line_naming_the_file():
    t = torch.arange(1000, dtype=torch.int32)
    spec = WriteSpec("t", t.dtype, tuple(t.shape), t.split(77))
    with pytest.raises(MlacError, match=r"^/dev/full: write failed \(.*No space left on device\)$"):
        write_safetensors_lockstep([Path("/dev/full")], [[spec]], piece=512)


# -- loading -------------------------------------------------------------------------------------


def test_the_big_file_is_in_pieces(pieced):
    files = {f.path: f for f in Manifest.load(pieced).files}
    big = files[f"{RANK}/big.safetensors"]
    assert big.pieces is not None and len(big.pieces.sha256) > 200


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_a_file_in_pieces_loads_bit_identically_with_any_threads(pieced, monkeypatch, threads):
    monkeypatch.setattr(readpass, "CHUNK", 300)  # several reads per piece, not aligned with them
    want = reference(pieced, torch.float32)
    assert_same(load_artifact(pieced, dtype=torch.float32, threads=threads).tensors, want)
    assert_same(start_load(pieced, dtype=torch.float32, threads=threads).join().tensors, want)


@pytest.mark.gpu
def test_pieces_on_cuda_through_pinned_staging_equal_the_cpu_load(pieced, monkeypatch):
    monkeypatch.setattr(readpass, "CHUNK", 300)  # many staged copies per piece, both buffers reused
    cpu = load_artifact(pieced, dtype=torch.bfloat16).tensors
    for load in (load_artifact, lambda *a, **k: start_load(*a, **k).join()):
        gpu = load(pieced, device="cuda", dtype=torch.bfloat16, threads=5).tensors
        assert {t.device.type for t in gpu.values()} == {"cuda"}
        assert_same({k: t.cpu() for k, t in gpu.items()}, cpu)


def test_the_pieces_of_one_file_are_read_by_several_threads(pieced, monkeypatch):
    real, readers = readpass.read_exact, {}

    def slow_read(fd, view, offset, rel):
        readers.setdefault(rel, set()).add(threading.get_ident())
        time.sleep(0.0005)  # let the other threads take pieces meanwhile
        real(fd, view, offset, rel)

    monkeypatch.setattr(readpass, "read_exact", slow_read)
    load_artifact(pieced, dtype=torch.float32, threads=4)
    assert len(readers[f"{RANK}/big.safetensors"]) > 1


def test_only_a_few_files_hold_a_destination_at_once(tmp_path, monkeypatch):
    """Ranges are queued file by file: with 2 threads, at most 3 files are allocated and unfinished."""
    files = {f"f{i}.safetensors": {f"f{i}.w": torch.randn(1500)} for i in range(8)}  # 7 pieces each
    root = with_pieces(make_artifact(tmp_path / "a", files))
    allocate, placed, open_, most = readpass._Lane._destination, readpass._File.placed, set(), []

    def counted_allocate(lane, size):
        dest = allocate(lane, size)
        open_.add(dest.data_ptr())
        most.append(len(open_))
        return dest

    def counted_placed(state):
        last = placed(state)
        if last:
            open_.discard(state.dest.data_ptr())
        return last

    monkeypatch.setattr(readpass._Lane, "_destination", counted_allocate)
    monkeypatch.setattr(readpass._File, "placed", counted_placed)
    loaded = load_artifact(root, dtype=torch.float32, threads=2).tensors
    assert_same(loaded, reference(root, torch.float32))
    assert len(most) == 8 and max(most) <= 3 and not open_


@pytest.mark.parametrize("k", [0, 5, -1])  # the first piece, one inside, the short last one
def test_a_flipped_byte_in_piece_k_is_refused_naming_the_file_and_piece(art, k):
    path = art / RANK / "big.safetensors"
    size = path.stat().st_size
    begin = (k % -(-size // PIECE)) * PIECE
    flip(path, begin + PIECE - 1 if k >= 0 else size - 1)  # (piece 0 begins with the header)
    where = rf"big.safetensors: sha256 of bytes \[{begin}, {min(begin + PIECE, size)}\) does not match"
    for threads in (1, 4):
        with pytest.raises(MlacError, match=where):
            load_artifact(art, threads=threads)
        with pytest.raises(MlacError, match=where):
            start_load(art, threads=threads).join()
    with pytest.raises(MlacError, match=where):
        verify_files(art, Manifest.load(art).files)


def test_verify_hashes_pieces_on_several_threads_and_counts_every_byte(pieced, monkeypatch):
    real, readers, counted = core_files.sha256_range, {}, []

    def slow_range(path, begin, end):
        readers.setdefault(path.name, set()).add(threading.get_ident())
        time.sleep(0.0005)  # let the other threads take pieces meanwhile
        return real(path, begin, end)

    monkeypatch.setattr(core_files, "sha256_range", slow_range)
    manifest = Manifest.load(pieced)
    verify_files(pieced, manifest.files, progress=counted.append, threads=4)
    assert len(readers["big.safetensors"]) > 1
    assert sum(counted) == sum(f.size for f in manifest.files)


def test_no_verify_checks_sizes_only(art, pieced):
    flip(art / RANK / "big.safetensors", 5017)  # inside big.w
    loaded = load_artifact(art, dtype=torch.float32, verify=False, threads=4).tensors
    assert_same(loaded, reference(art, torch.float32))  # the flipped byte is loaded, not seen
    assert not torch.equal(loaded["big.w"], reference(pieced, torch.float32)["big.w"])
    path = art / RANK / "part-1.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(MlacError, match="part-1.safetensors: size"):
        load_artifact(art, verify=False)


def test_a_file_that_holds_no_tensors_is_checked_in_pieces_too(artifact, tmp_path):
    root = with_pieces(Path(shutil.copytree(artifact("tiny-v3"), tmp_path / "a")))
    tok = Manifest.load(root).files
    entry = next(f for f in tok if f.path == "tokenizer/tokenizer.json")
    assert entry.pieces is not None and len(entry.pieces.sha256) > 2
    assert_same(load_artifact(root, threads=3).tensors, load_artifact(artifact("tiny-v3")).tensors)
    flip(root / entry.path, 2 * PIECE)
    with pytest.raises(MlacError, match=rf"tokenizer.json: sha256 of bytes \[{2 * PIECE}, {3 * PIECE}\)"):
        load_artifact(root, threads=3)
    load_artifact(root, verify=False)  # not read at all without hashing


# -- versions ------------------------------------------------------------------------------------


def test_a_manifest_written_without_pieces_still_loads_and_verifies(art):
    old = without_pieces(art)
    assert '"pieces"' not in (old / "manifest.json").read_text()
    assert Manifest.load(old).schema_version == 1
    assert_same(load_artifact(old, dtype=torch.float32, threads=4).tensors, reference(old, torch.float32))
    flip(old / RANK / "big.safetensors", 5017)
    for check in (lambda: load_artifact(old, threads=4), lambda: verify_files(old, Manifest.load(old).files)):
        with pytest.raises(MlacError, match=r"big.safetensors: sha256 does not match the manifest"):
            check()


def test_pieces_in_a_version_1_manifest_are_refused(art):
    with_pieces(art, version=1)
    with pytest.raises(
        MlacError, match=r"invalid manifest at : Value error, piece hashes .* schema_version 2"
    ):
        Manifest.load(art)


def test_a_newer_schema_version_is_refused_clearly(art):
    m = json.loads((art / "manifest.json").read_text())
    m["schema_version"] = 4
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        MlacError, match=r"schema_version 4 is newer than this mlac reads \(1, 2, 3\); upgrade"
    ):
        Manifest.load(art)


@pytest.mark.parametrize("change", ["one more", "one less", "piece as big as the file"])
def test_pieces_that_do_not_tile_the_file_are_refused(art, change):
    m = json.loads((art / "manifest.json").read_text())
    big = next(f for f in m["files"] if f["path"].endswith("big.safetensors"))
    if change == "one more":
        big["pieces"]["sha256"].append("0" * 64)
    elif change == "one less":
        big["pieces"]["sha256"].pop()
    else:
        big["pieces"] = {"size": big["size"], "sha256": [big["sha256"]]}
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        MlacError, match=r"invalid manifest at files\.\d+: .*big.safetensors: \d+ piece hashes"
    ):
        Manifest.load(art)
