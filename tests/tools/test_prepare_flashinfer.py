"""FlashInfer's modules in a kernel-cache unit: `prepare` for the flashinfer backend stores the
libraries FlashInfer built in its (fresh) workspace under flashinfer/, with its version; at start
they are copied, checked, into a fresh workspace that FLASHINFER_WORKSPACE_BASE points at; and
`--require-prepared` refuses a unit without them. On CPU, as test_prepare.py does for Triton: a
simulated GPU target and a warm-up that writes the files FlashInfer's JIT would write."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from test_prepare import KEY, SIG, fake_warm, unit_dir, use

import mlac.runtime.worker.kernel_cache as kc
import mlac.tools.prepare as prep
from mlac.core.errors import IntegrityError, MlacError, TargetMismatch
from mlac.core.units import UNIT_MANIFEST, load_unit
from mlac.core.validity import check_artifact
from mlac.kernels.attention.flashinfer_mla import WORKSPACE_ENV

VERSION = "0.6.11"
MODULE = "batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_sm90"
REL = f".cache/flashinfer/{VERSION}/90a/cached_ops/{MODULE}/{MODULE}.so"


@pytest.fixture
def art(artifact, tmp_path) -> Path:
    return Path(shutil.copytree(artifact("tiny-v2-lite"), tmp_path / "art"))


@pytest.fixture
def here(monkeypatch, tmp_path):
    """This process "runs" on SIG's GPU with flashinfer VERSION "installed" (test_prepare.on_gpu's
    simulation); Triton's cache directory and FlashInfer's workspace variable restored after."""
    monkeypatch.setattr(prep, "current_target", lambda device="cuda": SIG)
    monkeypatch.setattr(kc, "current_target", lambda device="cuda": SIG)
    monkeypatch.setenv(kc.TRITON_CACHE_ENV, str(tmp_path / "triton-default"))
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    monkeypatch.setattr(prep, "flashinfer_version", lambda: VERSION)
    monkeypatch.setattr(kc, "flashinfer_version", lambda: VERSION)
    yield
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is not None:
        del knobs.cache.dir


def fi_warm(backends: list[str]):
    """A warm-up per backend: Triton's files (fake_warm) once, and for flashinfer what FlashInfer's JIT
    leaves in its workspace: the module's library, objects, build file, generated source, log."""
    triton = fake_warm()

    def warm(root, cache_dir: Path, options) -> None:
        backend = options.runtime.attention_backend
        backends.append(backend)
        if len(backends) == 1:
            triton(root, cache_dir, options)
        if backend != "flashinfer":
            return
        base = Path(os.environ[WORKSPACE_ENV])  # set before anything builds
        lib = base / REL
        lib.parent.mkdir(parents=True)
        for name, data in (
            (lib.name, b"\x7fELF module"),
            ("build.ninja", b"x"),
            ("batch_mla_run.cuda.o", b"o"),
        ):
            (lib.parent / name).write_bytes(data)
        gen = lib.parents[2] / "generated" / MODULE
        gen.mkdir(parents=True)
        (gen / "batch_mla_run.cu").write_text("//")

    return warm


def test_prepare_stores_flashinfers_modules_in_the_same_unit(art, here):
    warmed: list[str] = []
    unit, folder = prep.prepare(art, warm=fi_warm(warmed), backends=["triton", "flashinfer"])
    assert warmed == ["triton", "flashinfer"]  # one engine per backend, in turn
    assert unit.flashinfer == VERSION and load_unit(folder) == unit
    assert [f.path for f in unit.files_under("flashinfer")] == [f"flashinfer/{REL}"]  # the library alone
    assert len(unit.files_under("triton")) == 3
    assert json.loads((folder / UNIT_MANIFEST).read_text())["flashinfer"] == VERSION
    assert check_artifact(art).units[KEY] == unit  # listed and hashed like Triton's files
    assert WORKSPACE_ENV not in os.environ  # the workspace pointed back


def test_a_unit_without_flashinfer_leaves_the_field_out(art, here):
    unit, folder = prep.prepare(art, warm=fake_warm())
    assert unit.flashinfer is None and "flashinfer" not in json.loads((folder / UNIT_MANIFEST).read_text())


def test_a_flashinfer_warmup_that_built_nothing_is_refused(art, here):
    with pytest.raises(MlacError, match="the flashinfer warm-up built no FlashInfer module"):
        prep.prepare(art, warm=fake_warm(), backends=["flashinfer"])


def test_start_copies_the_modules_into_a_fresh_workspace(art, here):
    prep.prepare(art, warm=fi_warm([]), backends=["triton", "flashinfer"])
    triton_dir = use(art, attention_backend="flashinfer")
    base = Path(os.environ[WORKSPACE_ENV])
    assert (base / REL).read_bytes() == b"\x7fELF module"
    assert base != triton_dir and not (triton_dir / ".cache").exists()  # Triton's copy: triton/ alone
    assert sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) == [REL]


def test_the_triton_backend_leaves_flashinfer_alone(art, here):
    prep.prepare(art, warm=fi_warm([]), backends=["flashinfer"])
    use(art, mode="require")
    assert WORKSPACE_ENV not in os.environ


def test_require_prepared_refuses_a_unit_without_flashinfers_modules(art, here, caplog):
    prep.prepare(art, warm=fake_warm())
    with pytest.raises(TargetMismatch, match=f"--require-prepared: the kernel cache {KEY} holds no FlashInfer "
                       "modules; run `mlac prepare ARTIFACT --attention-backend flashinfer` on this GPU"):  # fmt: skip
        use(art, mode="require", attention_backend="flashinfer")
    assert use(art, attention_backend="flashinfer") is not None  # without require: Triton's, and a warning
    assert "FlashInfer compiles its modules on first use" in caplog.text
    assert WORKSPACE_ENV not in os.environ


def test_modules_of_another_flashinfer_version_are_not_used(art, here, monkeypatch):
    prep.prepare(art, warm=fi_warm([]), backends=["flashinfer"])
    monkeypatch.setattr(kc, "flashinfer_version", lambda: "0.7.0")
    with pytest.raises(TargetMismatch, match=f"holds FlashInfer {VERSION}'s modules, not 0.7.0's"):
        use(art, mode="require", attention_backend="flashinfer")


def test_a_tampered_module_is_refused(art, here):
    prep.prepare(art, warm=fi_warm([]), backends=["flashinfer"])
    lib = unit_dir(art) / "flashinfer" / REL
    lib.write_bytes(lib.read_bytes()[:-1] + b"X")
    with pytest.raises(IntegrityError, match=f"cache/{KEY}/flashinfer/{REL}: sha256 does not match"):
        use(art, attention_backend="flashinfer")
