"""`mlac export onnx ARTIFACT OUT_DIR`: check the artifact, build the graph, write OUT_DIR atomically.

    OUT_DIR/
      model.onnx        the graph (graph.py); weights as external data, in one of two layouts:
      model.onnx.data   (packed, the default) the used tensors' bytes as stored, page-aligned
      weights/          (linked: link_weights) hard links to the artifact's safetensors files
      mlac_onnx.json    how to feed the graph (graph.io_spec) and what it came from
      tokenizer/        the artifact's tokenizer files, copied

As the compiler's writer does (compiler/writer.py, whose helpers this reuses), everything is written
in a temporary sibling folder `.<OUT_DIR>.tmp-<pid>` and renamed into place only once the graph has
passed `onnx.checker.check_model(full_check=True)` with its external data; a failure removes the
folder, and an existing OUT_DIR is replaced only with `force`. Memory holds the graph (no weights)
and, packed, one copy buffer: the data file is streamed tensor by tensor from the artifact's files.

Only one-rank artifacts are exported: a multi-rank artifact (`--tp` > 1) is refused with a message
saying to compile with `--tp 1` (merging the shards of every tensor back is not implemented).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from mlac.core.artifact import TOKENIZER_DIR, Manifest, check_identity
from mlac.core.atomic import check_not_source, remove_stale_tmp, tmp_dir
from mlac.core.errors import MlacError
from mlac.core.files import verify_files
from mlac.export.onnx.builder import OPSET, GraphBuilder
from mlac.export.onnx.data import Layout, Progress, choose_layout
from mlac.export.onnx.graph import build_model, io_spec
from mlac.export.onnx.weights import ArtifactWeights

GRAPH_FILE = "model.onnx"
SPEC_FILE = "mlac_onnx.json"


@dataclass
class OnnxExport:
    """A checked, planned export: the graph is built, nothing is written yet (`write` does it)."""

    artifact: Path
    out: Path
    manifest: Manifest
    identity: str
    model: onnx.ModelProto
    layout: Layout
    verify: bool

    @property
    def data_bytes(self) -> int:
        """The bytes of the weight files in OUT_DIR (linked: the artifact's, no new disk)."""
        return self.layout.data_bytes

    @property
    def total_bytes(self) -> int:
        """What `write` reports to `progress`: the artifact's bytes hashed (with verify), then the data."""
        hashed = sum(f.size for f in self.manifest.files) if self.verify else 0
        return hashed + self.layout.write_bytes

    def write(self, progress: Progress = lambda n: None, log: Callable[[str], None] = lambda m: None) -> Path:
        """Verify the artifact's hashes, write every file in a temporary folder, check the graph with
        its data (linked: stand-ins, then the hard links), then rename the folder to OUT_DIR
        (replacing an old one only now)."""
        verify_files(self.artifact, self.manifest.files, progress=progress, hashes=self.verify)
        for stale in remove_stale_tmp(self.out):
            log(f"removed {stale}: the temporary folder of an export that no longer runs")
        tmp = tmp_dir(self.out, os.getpid())
        tmp.mkdir()
        try:
            self._write_files(tmp, progress)
            onnx.checker.check_model(str(tmp / GRAPH_FILE), full_check=True)
            self.layout.link(tmp, progress)  # linked: after the check, which refuses hard links
            _rename_into_place(tmp, self.out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.out

    def _write_files(self, tmp: Path, progress: Progress) -> None:
        self.layout.write(tmp, progress)
        (tmp / GRAPH_FILE).write_bytes(self.model.SerializeToString())
        tokenizer = self.artifact / TOKENIZER_DIR
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, tmp / TOKENIZER_DIR)
        spec = self.spec(tokenizer_file=(tmp / TOKENIZER_DIR / "tokenizer.json").is_file())
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")

    def spec(self, tokenizer_file: bool) -> dict:
        """The JSON beside the graph: files, opset, where it came from, and how to feed it."""
        return {
            "graph": GRAPH_FILE,
            "data": self.layout.files,  # external data files, relative to OUT_DIR
            "weights_layout": self.layout.name,  # "packed", or "linked" (hard links to the artifact's files)
            "opset": OPSET,
            "tokenizer": f"{TOKENIZER_DIR}/tokenizer.json" if tokenizer_file else None,
            "artifact_identity": self.identity,
            "weights": self.manifest.quantization.scheme,  # "none" or "fp8-block" (DequantizeLinear)
            **io_spec(self.manifest.model),
        }


def plan_export(
    artifact: str | Path,
    out: str | Path,
    force: bool = False,
    verify: bool = True,
    link_weights: bool = False,
) -> OnnxExport:
    """Check the artifact (identity, one rank, sizes) and OUT_DIR, and build the graph over one
    packed data file, or with `link_weights` over the artifact's own files hard-linked into OUT_DIR
    (data.py). Raises MlacError before anything is written."""
    root, out_path = Path(artifact), Path(out).absolute()
    manifest = Manifest.load(root)
    identity = check_identity(root, manifest, required=True)
    if manifest.plan.world_size > 1:
        raise MlacError(
            f"{root}: a {manifest.plan.world_size}-rank artifact (tp={manifest.plan.tp}); ONNX export takes "
            "a one-rank artifact: compile it again with --tp 1"
        )
    verify_files(root, manifest.files, hashes=False)  # present, with their sizes
    check_out_dir(out_path, root, force)
    layout = choose_layout(root, out_path, link_weights)
    model = build_model(manifest.model, ArtifactWeights(root, manifest, GraphBuilder(), layout))
    return OnnxExport(root, out_path, manifest, identity, model, layout, verify)


def check_out_dir(out: Path, artifact: Path, force: bool) -> None:
    """OUT_DIR must not overlap the artifact, must not exist (unless `force` and a directory), and
    its parent must be a directory (created if missing)."""
    check_not_source(out, artifact)
    if out.exists() and not force:
        raise MlacError(f"{out}: already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise MlacError(f"{out}: exists and is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MlacError(f"{out}: cannot create its parent folder ({e.strerror})") from None
    if not os.access(out.parent, os.W_OK):
        raise MlacError(f"{out.parent}: not writable")


def _rename_into_place(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
