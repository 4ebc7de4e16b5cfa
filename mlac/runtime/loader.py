"""Strict artifact loading: verify files, then load one rank's tensors exactly as the manifest says.

A rank reads only its own files (its `rank-XXXXX-of-YYYYY/` folder; rank 0 also the shared files
such as the tokenizer): the ranks of a multi-rank artifact load in parallel, each hashing and
reading its own slice. The only conversion at load time: non-FP8 floating tensors are cast to
the compute dtype. FP8 weights stay FP8; their block scales and the router's correction bias
stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mlac.artifact import FileEntry, Manifest, TensorEntry, check_identity, check_inside, verify_files
from mlac.errors import MlacError

KEEP_FLOAT32 = (".scale", ".gate_bias")  # tensor contract: float32 whatever the compute dtype


@dataclass(frozen=True)
class LoadedRank:
    manifest: Manifest
    rank: int
    tensors: dict[str, torch.Tensor]


def rank_files(manifest: Manifest, rank: int) -> list[FileEntry]:
    """The files rank `rank` reads: its own folder; rank 0 also every file outside the rank folders."""
    own = manifest.rank_dir(rank) + "/"
    shared = lambda path: not path.startswith("rank-")  # noqa: E731 (tokenizer/, tuning/, cache/)
    return [f for f in manifest.files if f.path.startswith(own) or (rank == 0 and shared(f.path))]


def check_files(root: Path, manifest: Manifest, verify: bool = True, rank: int | None = None) -> None:
    """Every file of `rank` (of every rank if None) exists with its size; with `verify`, its sha256
    too (the tamper check)."""
    verify_files(root, manifest, files=None if rank is None else rank_files(manifest, rank), hashes=verify)


def load_artifact(
    path: str | Path,
    rank: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    verify: bool = True,
) -> LoadedRank:
    """Load rank `rank` of the artifact at `path`; raise MlacError on any mismatch with the manifest."""
    root = Path(path)
    manifest = Manifest.load(root)
    check_identity(root, manifest, required=verify)  # the manifest unedited; no file a symlink
    if not 0 <= rank < len(manifest.tensors):
        raise MlacError(
            f"{root}: rank {rank} out of range (the artifact has {len(manifest.tensors)} rank(s))"
        )
    check_files(root, manifest, verify, rank)
    expected = manifest.tensors[rank]
    by_file: dict[str, dict[str, TensorEntry]] = {}
    for name, entry in expected.items():
        by_file.setdefault(entry.file, {})[name] = entry
    _check_rank_files(root, manifest, rank, by_file)
    tensors: dict[str, torch.Tensor] = {}
    for rel, entries in sorted(by_file.items()):
        tensors.update(_load_file(root / rel, rel, entries, device, dtype))
    return LoadedRank(manifest, rank, tensors)


def _check_rank_files(root: Path, manifest: Manifest, rank: int, by_file: dict[str, dict]) -> None:
    """Tensor files must be hashed in the manifest, among the files this rank checked; the rank
    folder must hold no other tensor file."""
    hashed = {entry.path for entry in rank_files(manifest, rank)}
    for rel in by_file:
        check_inside(rel, root / "manifest.json")
        if rel not in hashed:
            raise MlacError(
                f"{rel}: holds tensors but is not listed (hashed) in the manifest's files of rank {rank}"
            )
    rank_dir = root / manifest.rank_dir(rank)
    for p in sorted(rank_dir.glob("*.safetensors")) if rank_dir.is_dir() else []:
        rel = p.relative_to(root).as_posix()
        if rel not in by_file:
            raise MlacError(f"{rel}: extra tensor file not named by the manifest; refusing to load")


def _load_file(
    path: Path, rel: str, entries: dict[str, TensorEntry], device: torch.device | str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:  # mmap: pages come in on use
        names = set(f.keys())
        for name in sorted(names - entries.keys()):
            raise MlacError(f"{rel}: extra tensor {name!r} not in the manifest")
        for name in sorted(entries.keys() - names):
            raise MlacError(f"{rel}: tensor {name!r} listed in the manifest is missing from the file")
        for name, entry in sorted(entries.items()):
            sl = f.get_slice(name)
            got_dtype, got_shape = sl.get_dtype(), list(sl.get_shape())
            if got_dtype != entry.dtype or got_shape != entry.shape:
                raise MlacError(
                    f"{rel}: tensor {name!r} is {got_dtype}{got_shape}, "
                    f"the manifest says {entry.dtype}{entry.shape}"
                )
            out[name] = to_compute_dtype(name, f.get_tensor(name), dtype).to(device)
    return out


def to_compute_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one load-time conversion: non-FP8 floating tensors (but scales and gate_bias) -> dtype."""
    if not t.is_floating_point() or t.element_size() == 1 or name.endswith(KEEP_FLOAT32):
        return t
    return t.to(dtype)
