"""The local store behind `mlac serve oci://...` (and generate, bench): pull once, start from disk.

    <download-dir>/artifacts/<identity>/     a pulled artifact, complete (its folder name: its identity)
    <download-dir>/blobs/sha256/<hex>        every file pulled, by digest: a later pull of another
                                             artifact links the files they share instead of
                                             downloading them
    <download-dir>/refs/<host>/<repo>/<tag>  the identity a tag named when last pulled

A start asks the registry for the tag's manifest (a few hundred bytes) and finds its identity in the
store: a second start downloads nothing. When the registry cannot be reached, the identity the tag
named last time is used, with a warning. The download folder defaults to the user's cache folder
($XDG_CACHE_HOME/mlac, else ~/.cache/mlac).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from mlac.core.errors import RegistryError
from mlac.ship import oci
from mlac.ship.pull import Target, node_ranks, pull, pull_size, resolve
from mlac.ship.reference import Reference, parse
from mlac.ship.registry import Registry

Log = Callable[[str], None]


def default_download_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache) if cache else Path.home() / ".cache") / "mlac"


def local_artifact(
    text: str,
    download_dir: Path | None = None,
    plain_http: bool = False,
    target: Target = "auto",
    node: tuple[int, int] | None = None,
    progress_factory: Callable[[int], object] | None = None,
    log: Log = lambda m: None,
    device: str = "cuda",
) -> Path:
    """The folder of the artifact `text` (oci://...) names, pulled into the store if not there yet."""
    ref = parse(text)
    store = download_dir or default_download_dir()
    reg = Registry(ref, plain_http)
    try:
        body, _ = reg.get_manifest(ref.target)
    except RegistryError as e:
        known = _remembered(store, ref)
        if known is None or "not found" in str(e):
            raise
        log(f"warning: {e}; using {known}, which {ref} named when it was last pulled")
        return known
    if oci.kind_of(body) != "artifact":
        raise RegistryError(f"{ref}: not an mlac artifact")
    identity = body["config"]["digest"].removeprefix("sha256:")
    folder = store / "artifacts" / identity
    if folder.is_dir():
        log(f"{ref}: artifact {identity[:16]}... already in {store} (nothing downloaded)")
        _remember(store, ref, identity)
        return folder
    remote = resolve(reg)
    ranks = node_ranks(remote.manifest.plan.world_size, node) if node else None
    dest = folder if ranks is None else store / "artifacts" / f"{identity}.ranks-{ranks[0]}-{ranks[-1]}"
    if dest.is_dir():
        return dest
    log(f"{ref}: pulling artifact {identity[:16]}... into {store}")
    progress = progress_factory(pull_size(remote, ranks)) if progress_factory else None
    with progress if progress is not None else _Null() as bar:
        done = pull(ref, dest, ranks=ranks, target=target, plain_http=plain_http, progress=getattr(bar, "update", None),
                    grow=getattr(bar, "grow", None), log=log, blobs=store / "blobs", device=device, remote=remote)  # fmt: skip
    log(f"pulled {done.downloaded_bytes / 1e9:.3f} GB in {done.seconds:.1f} s ({done.gb_per_s:.2f} GB/s)")
    _remember(store, ref, identity)
    return dest


def _ref_file(store: Path, ref: Reference) -> Path:
    return store / "refs" / ref.registry.replace(":", "_") / ref.repository / (ref.tag or "latest")


def _remember(store: Path, ref: Reference, identity: str) -> None:
    if ref.digest is not None:
        return
    path = _ref_file(store, ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(identity + "\n")
    tmp.replace(path)


def _remembered(store: Path, ref: Reference) -> Path | None:
    if ref.digest is not None:
        return None  # a digest names an OCI manifest, not an identity: nothing remembered
    path = _ref_file(store, ref)
    if not path.is_file():
        return None
    folder = store / "artifacts" / path.read_text().strip()
    return folder if folder.is_dir() else None


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
