"""Kernel-cache units (`mlac prepare`), their target signature, and their use at start.

On CPU a GPU target is simulated: `current_target` returns a fixed signature, and the warm-up that
`prepare` runs writes Triton cache files into the directory it is given (fake files, or a real
Triton compile for an sm90 target, which needs no GPU). The GPU test at the end prepares a tiny
artifact for real and counts the JIT compiles of a fresh server process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import invoke, one_line_error
from _paths import REPO

import mlac.runtime.worker.kernel_cache as kc
import mlac.tools.prepare as prep
from mlac.core.artifact import IDENTITY, MANIFEST, Manifest, artifact_identity, identity_record
from mlac.core.errors import IntegrityError, MlacError, TargetMismatch
from mlac.core.files import file_entry
from mlac.core.units import UNIT_IDENTITY, UNIT_MANIFEST, TargetSignature, load_unit, target_key
from mlac.core.validity import check_artifact
from mlac.runtime.engine.engine import Engine
from mlac.runtime.serve import ServerConfig, load_engine

SIG = TargetSignature(gpu_name="NVIDIA H200", compute_capability="9.0", cuda="13.0", driver="580.65.06",
                      torch="2.11.0", triton="3.6.0")  # fmt: skip
KEY = "sm90-nvidia-h200-triton3.6.0-torch2.11.0-cu13.0"
KERNEL = "ABCDEF234567"  # a Triton cache entry (its folder is named by the kernel's hash)


@pytest.fixture
def art(artifact, tmp_path) -> Path:
    return Path(shutil.copytree(artifact("tiny-v2-lite"), tmp_path / "art"))


@pytest.fixture
def on_gpu(monkeypatch, tmp_path):
    """This process "runs" on the GPU of SIG (`on_gpu(sig)` switches it); Triton's cache directory
    and knobs are restored after the test."""
    here = {"sig": SIG}
    monkeypatch.setattr(prep, "current_target", lambda device="cuda": here["sig"])
    monkeypatch.setattr(kc, "current_target", lambda device="cuda": here["sig"])
    monkeypatch.setenv(kc.TRITON_CACHE_ENV, str(tmp_path / "triton-default"))
    yield lambda sig: here.update(sig=sig)
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is not None:
        del knobs.cache.dir


def fake_warm(version: bytes = b"v1"):
    """A warm-up that writes a Triton cache entry (binary, metadata, a group file naming them by
    absolute path, as Triton writes it, and an unfinished tmp folder) into the directory it is given."""

    def warm(root, cache_dir: Path, options) -> None:
        assert os.environ[kc.TRITON_CACHE_ENV] == str(cache_dir)  # set before anything compiles
        entry = cache_dir / KERNEL
        entry.mkdir()
        (entry / "k.cubin").write_bytes(b"\x7fELF cubin " + version)
        (entry / "k.json").write_text(json.dumps({"name": "k", "version": version.decode()}))
        group = {"child_paths": {n: str(entry / n) for n in ("k.cubin", "k.json")}}
        (entry / "__grp__k.json").write_text(json.dumps(group))
        (entry / "tmp.pid_1_x").mkdir()
        (entry / "tmp.pid_1_x" / "partial.cubin").write_bytes(b"half")

    return warm


def unit_dir(root: Path, key: str = KEY) -> Path:
    return root / "cache" / key


def cache_file(root: Path, name: str = "k.cubin", key: str = KEY) -> Path:
    return unit_dir(root, key) / "triton" / KERNEL / name


def use(art: Path, mode="use", **kw):
    return kc.use_kernel_cache(check_artifact(art, hashes=False), "cuda", mode=mode, **kw)


def legacy_prepared(art: Path) -> Path:
    """The artifact as a prepare of schema 2 left it: the unit's files listed in the manifest under
    cache/<key>/triton, the target in `caches`, the identity recomputed (prepare changed it then)."""
    unit = load_unit(unit_dir(art))
    shutil.rmtree(unit_dir(art))
    m = json.loads((art / MANIFEST).read_text())
    m["schema_version"] = 2
    m.pop("provenance")
    for f in unit.files:
        (art / "cache" / KEY / f.path).parent.mkdir(parents=True, exist_ok=True)
        m["files"].append({"path": f"cache/{KEY}/{f.path}", "size": f.size, "sha256": f.sha256})
    m["caches"] = [{"key": KEY, "signature": unit.signature.model_dump(mode="json"), "path": f"cache/{KEY}/triton",
                    "files": len(unit.files), "bytes": unit.bytes}]  # fmt: skip
    return m


# ---- the signature and the manifest ----------------------------------------------------------


def test_target_key_names_arch_gpu_and_versions():
    assert target_key(SIG) == KEY
    other = SIG.model_copy(
        update={"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "cuda": None}
    )
    assert target_key(other) == "sm80-nvidia-a100-sxm4-80gb-triton3.6.0-torch2.11.0-cunone"


def test_manifest_without_caches_loads_and_bad_cache_path_is_refused(art):
    raw = json.loads((art / MANIFEST).read_text())
    assert "caches" not in raw or raw.pop("caches") == []
    assert Manifest.model_validate(raw).caches == []  # manifests written before prepare existed
    cache = dict(key=KEY, signature=SIG.model_dump(), path="rank-00000-of-00001", files=0, bytes=0)
    raw.pop("provenance")
    (art / MANIFEST).write_text(json.dumps({**raw, "schema_version": 2, "caches": [cache]}))
    with pytest.raises(MlacError, match="kernel cache .* not cache/<key>/triton"):
        Manifest.load(art)
    (art / MANIFEST).write_text(json.dumps({**raw, "schema_version": 3, "caches": [cache]}))
    with pytest.raises(MlacError, match="schema_version 3 keeps kernel caches as units"):
        Manifest.load(art)


def test_current_target_is_none_on_cpu():
    from mlac.runtime.worker.target import current_target

    assert current_target("cpu") is None


# ---- prepare ------------------------------------------------------------------------------------


def test_prepare_writes_a_unit_and_leaves_the_identity_unchanged(art, on_gpu):
    before = {n: (art / n).read_bytes() for n in (MANIFEST, IDENTITY)}
    unit, folder = prep.prepare(art, warm=fake_warm())
    assert {n: (art / n).read_bytes() for n in before} == before  # the artifact's identity: unchanged
    assert folder == unit_dir(art) and unit.key == KEY and unit.signature == SIG
    assert unit.base_identity == artifact_identity(art) and load_unit(folder) == unit
    assert {f.path for f in unit.files} == {
        f"triton/{KERNEL}/{n}" for n in ("k.cubin", "k.json", "__grp__k.json")
    }
    assert all(file_entry(folder, f.path) == f for f in unit.files)  # sizes and sha256 as listed
    assert not (cache_file(art).parent / "tmp.pid_1_x").exists()  # Triton's unfinished writes left out
    group = json.loads(cache_file(art, "__grp__k.json").read_text())
    assert group["child_paths"] == {"k.cubin": f"{KERNEL}/k.cubin", "k.json": f"{KERNEL}/k.json"}
    r = invoke("verify", art)
    assert r.exit_code == 0 and "1 kernel-cache unit(s)" in r.output, r.output
    assert not list(art.glob(".*")) and not list(art.parent.glob(".*"))  # no temporary folder left
    assert check_artifact(art).units == {KEY: unit}


def test_prepare_cache_out_writes_only_the_unit(art, on_gpu, tmp_path):
    out = tmp_path / "unit"
    unit, folder = prep.prepare(art, warm=fake_warm(), cache_out=out)
    assert folder == out and not (art / "cache").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([UNIT_MANIFEST, UNIT_IDENTITY, "triton"])
    assert load_unit(out).base_identity == artifact_identity(art)
    shutil.copytree(out, unit_dir(art))  # dropped beside the artifact, it is used
    assert check_artifact(art).units[KEY] == unit
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(MlacError, match="exists and is not a kernel-cache unit"):
        prep.prepare(art, warm=fake_warm(), cache_out=tmp_path / "other")


def test_verify_and_the_loader_refuse_a_tampered_unit_file(art, on_gpu):
    prep.prepare(art, warm=fake_warm())
    f = cache_file(art)
    f.write_bytes(f.read_bytes()[:-1] + b"X")  # same size, other bytes
    rel = f.relative_to(art).as_posix()
    one_line_error(invoke("verify", art), rel, "sha256", code=3)  # an integrity failure
    with pytest.raises(IntegrityError, match=f"{rel}: sha256 does not match"):
        use(art)


def test_a_unit_of_another_artifact_or_an_unlisted_file_is_refused(art, on_gpu, tmp_path, artifact):
    other = Path(shutil.copytree(artifact("tiny-v2"), tmp_path / "other"))
    prep.prepare(other, warm=fake_warm())
    shutil.copytree(unit_dir(other), unit_dir(art))
    for check in (lambda: check_artifact(art), lambda: Engine.from_artifact(art, num_blocks=4)):
        with pytest.raises(IntegrityError, match="a kernel-cache unit of artifact .* not of this one"):
            check()
    shutil.rmtree(unit_dir(art))
    prep.prepare(art, warm=fake_warm())
    (unit_dir(art) / "triton" / "extra.cubin").write_bytes(b"injected")
    with pytest.raises(IntegrityError, match="extra.cubin: not part of the artifact"):
        check_artifact(art, hashes=False)


def test_prepare_twice_replaces_that_targets_unit_and_keeps_the_others(art, on_gpu):
    prep.prepare(art, warm=fake_warm(b"v1"))
    a100 = SIG.model_copy(update={"gpu_name": "NVIDIA A100", "compute_capability": "8.0"})
    on_gpu(a100)
    prep.prepare(art, warm=fake_warm(b"a100"))
    on_gpu(SIG)
    prep.prepare(art, warm=fake_warm(b"v2"))
    assert sorted(check_artifact(art).units) == sorted([KEY, target_key(a100)])
    assert cache_file(art).read_bytes().endswith(b"v2")
    assert cache_file(art, key=target_key(a100)).read_bytes().endswith(b"a100")
    assert len(load_unit(unit_dir(art)).files) == 3  # v1's entries replaced
    assert invoke("verify", art).exit_code == 0
    assert not list(art.parent.glob(".*"))


def test_an_interrupted_prepare_leaves_the_artifact_as_it_was(art, on_gpu, monkeypatch):
    before = {n: (art / n).read_bytes() for n in (MANIFEST, IDENTITY)}

    def crash(*args):
        raise RuntimeError("killed after the cache copy")

    monkeypatch.setattr(prep, "replace_folder", crash)
    with pytest.raises(RuntimeError, match="killed"):
        prep.prepare(art, warm=fake_warm())
    assert {n: (art / n).read_bytes() for n in before} == before
    assert not unit_dir(art).exists() and not list(art.parent.glob(".*tmp-*"))
    assert invoke("verify", art).exit_code == 0


def test_the_next_prepare_removes_a_dead_prepares_folder(art, on_gpu):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = art.parent / f".{art.name}.{KEY}.tmp-{dead.pid}"
    (stale / "triton").mkdir(parents=True)
    logged = []
    prep.prepare(art, warm=fake_warm(), log=logged.append)
    assert not stale.exists()
    assert any(str(stale) in line for line in logged)
    assert invoke("verify", art).exit_code == 0


def test_prepare_and_compile_prepare_without_a_gpu_are_one_line_errors(art, checkpoint, tmp_path):
    one_line_error(invoke("prepare", art, "--device", "cpu"), "prepare needs a CUDA GPU")
    if not __import__("torch").cuda.is_available():
        out = tmp_path / "out"
        one_line_error(invoke("compile", "--prepare", checkpoint("tiny-v2-lite"), out), "CUDA")
        assert not out.exists()  # refused before the compile


def test_inspect_lists_the_targets(art, on_gpu):
    assert "kernel caches none" in invoke("inspect", art).output
    prep.prepare(art, warm=fake_warm())
    out = invoke("inspect", art).output
    assert (
        f"kernel cache  {KEY}: NVIDIA H200, sm 9.0, CUDA 13.0, driver 580.65.06, torch 2.11.0, triton 3.6.0"
        in out
    )
    record = json.loads(invoke("inspect", art, "--json").output)
    assert record["identity"] == artifact_identity(art) and record["units"][0]["key"] == KEY


# ---- use at start -------------------------------------------------------------------------------


def test_the_matching_unit_is_copied_and_triton_pointed_at_it(art, on_gpu):
    prep.prepare(art, warm=fake_warm())
    dest = use(art)
    assert dest is not None and os.environ[kc.TRITON_CACHE_ENV] == str(dest)
    assert (dest / KERNEL / "k.cubin").read_bytes() == cache_file(art).read_bytes()
    group = json.loads((dest / KERNEL / "__grp__k.json").read_text())
    assert group["child_paths"]["k.cubin"] == str(
        dest / KERNEL / "k.cubin"
    )  # absolute again, as Triton reads


def test_an_artifact_prepared_the_old_way_still_loads_its_cache(art, on_gpu):
    prep.prepare(art, warm=fake_warm())
    data = cache_file(art).read_bytes()
    m = legacy_prepared(art)
    for f in m["files"][-3:]:
        (art / f["path"]).write_bytes(data if f["path"].endswith("k.cubin") else b"")
    cubin = next(f for f in m["files"] if f["path"].endswith("k.cubin"))
    group = {"child_paths": {"k.cubin": f"{KERNEL}/k.cubin", "k.json": f"{KERNEL}/k.json"}}
    payloads = {"k.cubin": data, "k.json": b"{}", "__grp__k.json": json.dumps(group).encode()}
    for f in m["files"][-3:]:
        name = f["path"].rsplit("/", 1)[1]
        (art / f["path"]).write_bytes(payloads[name])
        f.update(size=len(payloads[name]), sha256=file_entry(art, f["path"]).sha256)
    assert cubin["size"] == len(data)
    (art / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True))
    (art / IDENTITY).write_text(identity_record(artifact_identity(art)))
    assert Manifest.load(art).schema_version == 2 and invoke("verify", art).exit_code == 0
    dest = use(art)
    assert dest is not None and (dest / KERNEL / "k.cubin").read_bytes() == data


def test_a_cache_of_another_target_is_ignored_with_one_line_naming_the_field(art, on_gpu, caplog):
    prep.prepare(art, warm=fake_warm())
    on_gpu(SIG.model_copy(update={"triton": "3.5.1"}))
    with caplog.at_level(logging.WARNING, logger="mlac.kernel_cache"):
        assert use(art) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "kernel cache for sm90/NVIDIA H200/triton 3.6.0 not used: triton is 3.5.1 here (3.6.0 in the cache); "
        "kernels compile on first use"
    ]
    assert os.environ[kc.TRITON_CACHE_ENV].endswith("triton-default")  # Triton's own directory, untouched


def test_require_prepared_refuses_another_target(art, on_gpu):
    prep.prepare(art, warm=fake_warm())
    on_gpu(SIG.model_copy(update={"driver": "570.1"}))
    with pytest.raises(
        TargetMismatch, match=r"--require-prepared: .* driver is 570.1 here \(580.65.06 in the cache\)"
    ):
        Engine.from_artifact(art, kernel_cache="require")
    with pytest.raises(MlacError, match="driver is 570.1 here"):
        load_engine(ServerConfig.of(artifact=art, kernel_cache="require"))
    one_line_error(
        invoke("generate", art, "--prompt", "hi", "--require-prepared"),
        "--require-prepared",
        "driver",
        code=4,
    )
    assert Engine.from_artifact(art, num_blocks=4).generate([1, 2, 3], max_tokens=1).completion_tokens == 1


def test_require_prepared_refuses_an_artifact_without_caches(art, on_gpu):
    with pytest.raises(MlacError, match="holds no kernel cache"):
        use(art, mode="require")


# ---- a real Triton compile (an sm90 target compiles on CPU; it is not run) ----------------------

COMPILE_SM90 = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlac.runtime.worker.jit_compiles import JitCompiles

@triton.jit
def copy_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < n)

sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
with JitCompiles() as jit:
    triton.compile(ASTSource(copy_kernel, signature=sig, constexprs={"BLOCK": 16}), target=GPUTarget("cuda", 90, 32))
print(json.dumps({"compiled": jit.compiled, "loaded": jit.loaded}))
"""


def compile_sm90(where: Path) -> dict:
    """In a fresh process (this one's Triton may be in interpreter mode), with this process's
    TRITON_CACHE_DIR: which kernels Triton compiled and which it loaded from its cache."""
    script = where / "compile_sm90.py"  # a file: @triton.jit reads the kernel's source
    script.write_text(COMPILE_SM90)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_prepared_triton_kernel_is_loaded_not_compiled(art, on_gpu, tmp_path):
    pytest.importorskip("triton")
    seen = []
    unit, _ = prep.prepare(art, warm=lambda *args: seen.append(compile_sm90(tmp_path)))
    assert seen == [{"compiled": ["copy_kernel"], "loaded": []}]  # the counter sees a compile
    assert any(f.path.endswith("/__grp__copy_kernel.json") for f in unit.files)
    use(art)
    assert compile_sm90(tmp_path) == {"compiled": [], "loaded": ["copy_kernel"]}


# ---- on a GPU: a prepared artifact compiles nothing at start or in requests ---------------------

SERVE_AND_COUNT = r"""
import json, sys, httpx
import mlac.runtime.worker.kernel_cache as kc
from mlac.runtime.worker.jit_compiles import JitCompiles
from mlac.runtime.engine.scheduler import SchedulerConfig
from mlac.runtime.serve import ServerConfig, ServerThread

art, mode = sys.argv[1], sys.argv[2]
if mode == "off":  # as if the artifact held no cache of this GPU
    kc.current_target = lambda device: None
config = ServerConfig.of(artifact=art, device="cuda", scheduler=SchedulerConfig(max_running_requests=8,
    chunked_prefill_size=256), cuda_graph_max_bs=8, kernel_cache="require" if mode == "require" else "use")
counts = {}
with JitCompiles() as start:
    srv = ServerThread(config).start()
counts["start"] = start.compiled
with JitCompiles() as requests:
    try:
        for n in (1, 5, 16, 37, 64, 130):
            prompt = [3 + (7 * i) % 50 for i in range(n)]
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"model": srv.state.config.model_name, "prompt": prompt, "max_tokens": 8})
            assert r.status_code == 200, r.text
        prompts = [[3 + i] * (4 + i) for i in range(6)]
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": srv.state.config.model_name, "prompt": prompts, "max_tokens": 12})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
counts["requests"] = requests.compiled
print(json.dumps(counts))
"""


@pytest.mark.gpu
def test_a_prepared_artifact_compiles_nothing_in_a_fresh_server(art, tmp_path):
    """The proof: prepared by `mlac prepare` (a process that has run no kernel: prepare's NOTE), then a
    fresh process with an empty Triton home (TRITON_CACHE_DIR unset) serves with zero JIT compiles at
    start and during requests; unprepared, the same counts some."""
    env = {k: v for k, v in os.environ.items() if k != kc.TRITON_CACHE_ENV}
    limits = ["--max-running-requests", "8", "--chunked-prefill-size", "256", "--cuda-graph-max-bs", "8"]
    out = subprocess.run([sys.executable, "-m", "mlac.cli", "prepare", str(art), "--device", "cuda", *limits],
                         env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]

    def serve(mode: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k != kc.TRITON_CACHE_ENV}
        env["TRITON_HOME"] = str(tmp_path / f"home-{mode}")
        out = subprocess.run([sys.executable, "-c", SERVE_AND_COUNT, str(art), mode], env=env,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        assert out.returncode == 0, out.stderr[-4000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    got = serve("require")
    assert got == {"start": [], "requests": []}, got
    assert serve("off")["start"] != []  # the counter sees compiles where there is no cache
