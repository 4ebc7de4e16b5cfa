"""The commands that ship an artifact: sign, push, pull; and ARTIFACT arguments that may name a
registry (`serve oci://...`, generate, bench, eval), pulled into the local store first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mlac.cli.common import friendly_errors, log, print_json, progress
from mlac.core.errors import MlacError


class ArtifactSource(click.ParamType):
    """An artifact folder, or an `oci://HOST[:PORT]/REPO[:TAG]` reference (kept as its text)."""

    name = "ARTIFACT"

    def convert(self, value: Any, param, ctx) -> Path | str:
        from mlac.ship.reference import is_reference  # (parsed by `fetched`: its errors are one line)

        return value if isinstance(value, str) and is_reference(value) else Path(value)


ARTIFACT = ArtifactSource()


def fetched(source: Path | str, flags: dict, node: tuple[int, int] | None = None) -> Path:
    """The local folder of an ARTIFACT argument: itself, or (oci://) the store's copy, pulled now
    if the store lacks it (only this node's ranks with `node`, and this GPU's kernel-cache unit)."""
    if isinstance(source, Path):
        return source
    from mlac.ship.reference import parse
    from mlac.ship.store import local_artifact

    parse(source)  # an unknown scheme is one line here
    return local_artifact(source, flags.get("download_dir"), plain_http=bool(flags.get("plain_http")),
                          node=node, progress_factory=lambda n: progress(n, "pulling"), log=log)  # fmt: skip


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--key", "key", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="PEM elliptic-curve private key (openssl ecparam -name prime256v1 -genkey -noout -out key.pem).")  # fmt: skip
@click.option("--password-env", default=None, metavar="VAR",
              help="Environment variable holding the key's password, if it is encrypted.")  # fmt: skip
@friendly_errors
def sign(path, key, password_env):
    """Sign the artifact PATH (or a kernel-cache unit folder) with KEY: a Sigstore bundle
    (OpenSSF model-signing, key mode, no network) over the identity's files and digests, written
    beside the manifest (signature.sig.json; a unit's: unit.sig.json). Nothing is re-hashed: the
    digests are the manifest's, checked by `verify`. `mlac verify --public-key PUB.pem` checks it."""
    import os

    from mlac.core.artifact import MANIFEST, Manifest, artifact_identity
    from mlac.core.signed import artifact_signed, unit_signed
    from mlac.core.signing import sign as sign_folder
    from mlac.core.units import UNIT_MANIFEST, load_unit
    from mlac.core.validity import check_artifact

    password = os.environ.get(password_env) if password_env else None
    if password_env and password is None:
        raise MlacError(f"--password-env {password_env}: not set in the environment")
    if (path / UNIT_MANIFEST).is_file() and not (path / MANIFEST).is_file():
        signed = unit_signed(path, load_unit(path))
    else:
        check_artifact(path, hashes=False)  # a folder that would not load is not signed
        signed = artifact_signed(path, Manifest.load(path), artifact_identity(path))
    out = sign_folder(signed, key, password)
    click.echo(f"signed {path}: {out}")


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("reference")
@click.option("--plain-http", is_flag=True, help="Talk to the registry over plain HTTP (no TLS).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@friendly_errors
def push(path, reference, plain_http, as_json):
    """Push the artifact PATH (its signature and kernel-cache units with it), or a kernel-cache unit
    folder (`prepare --cache-out`), to REFERENCE: oci://HOST[:PORT]/REPO:TAG.

    Each file is one blob whose digest is the manifest's sha256 (nothing is hashed again; the
    registry checks each upload); blobs the registry holds are not sent again. The artifact's
    manifest.json is the OCI config. A unit is pushed to the artifact it was prepared for, linked to it."""
    from mlac.ship.push import push as run_push
    from mlac.ship.push import push_size
    from mlac.ship.reference import parse

    ref = parse(reference)
    if not path.is_dir():
        raise MlacError(f"{path}: not a folder (an artifact or a kernel-cache unit)")
    with progress(push_size(path), "pushing") as bar:
        done = run_push(path, ref, plain_http=plain_http, progress=bar.update)
    if as_json:
        print_json(vars(done))
        return
    click.echo(f"pushed {path} to {ref}: {done.files} files, {done.bytes / 1e9:.3f} GB ({done.uploaded_blobs} "
               f"blobs uploaded, {done.uploaded_bytes / 1e9:.3f} GB) in {done.seconds:.1f} s; identity {done.identity}")  # fmt: skip


def _ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: want rank numbers separated by commas (0,1)") from None
    if not ranks or min(ranks) < 0:
        raise click.BadParameter(f"{text!r}: want rank numbers >= 0")
    return ranks


@click.command()
@click.argument("reference")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--ranks", default=None, help="Pull only these ranks' folders (and the shared files): 0,1.")
@click.option(
    "--node-rank", type=click.IntRange(0), default=None, help="With --nnodes: pull node R's ranks only."
)
@click.option(
    "--nnodes", type=click.IntRange(1), default=None, help="Nodes the artifact's ranks are spread over."
)
@click.option("--target", type=click.Choice(["auto", "all", "none"]), default="auto", show_default=True,
              help="Kernel-cache units to pull: this GPU's (auto), every one, or none.")  # fmt: skip
@click.option("--device", default="cuda", show_default=True, help="The GPU whose unit --target auto pulls.")
@click.option("--force", is_flag=True, help="Replace PATH if it exists (only once the pull is complete).")
@click.option("--plain-http", is_flag=True, help="Talk to the registry over plain HTTP (no TLS).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@friendly_errors
def pull(reference, path, ranks, node_rank, nnodes, target, device, force, plain_http, as_json):
    """Pull the artifact at REFERENCE (oci://HOST[:PORT]/REPO:TAG) into the folder PATH.

    Only the shared files and the ranks asked for (default: all), the kernel-cache unit of this GPU
    (--target) and the signatures are downloaded, several blobs at once, each checked against its
    sha256 as it streams. An interrupted pull resumes when run again. PATH appears only once the
    pull is complete and checked as the loader checks it; `mlac verify PATH` passes."""
    from mlac.ship.pull import node_ranks, pull_size, resolve
    from mlac.ship.pull import pull as run_pull
    from mlac.ship.reference import parse
    from mlac.ship.registry import Registry

    if (node_rank is None) != (nnodes is None):
        raise MlacError("give --node-rank and --nnodes together")
    if ranks is not None and nnodes is not None:
        raise MlacError("give --ranks or --node-rank/--nnodes, not both")
    ref = parse(reference)
    remote = resolve(Registry(ref, plain_http))
    node = (node_rank, nnodes) if nnodes is not None else None
    chosen = node_ranks(remote.manifest.plan.world_size, node) if node else _ranks(ranks)
    with progress(pull_size(remote, chosen), "pulling") as bar:
        done = run_pull(ref, path, ranks=chosen, target=target, plain_http=plain_http, progress=bar.update,
                        grow=bar.grow, log=log, force=force, device=device, remote=remote)  # fmt: skip
    if as_json:
        print_json(vars(done) | {"gb_per_s": round(done.gb_per_s, 3)})
        return
    click.echo(f"pulled {ref} into {path}: ranks {','.join(map(str, done.ranks))}, {done.files} files, "
               f"{done.downloaded_bytes / 1e9:.3f} GB downloaded in {done.seconds:.1f} s ({done.gb_per_s:.2f} GB/s); "
               f"units {', '.join(done.units) or 'none'}; {'signed' if done.signed else 'unsigned'}; identity {done.identity}")  # fmt: skip
