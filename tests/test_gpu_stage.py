"""scripts/gpu_stage.py: what reaches a GPU machine without network access in parts is what was staged, and installs.

Claims: the parts are no larger than asked and join to the payload's sha256 (checked here with hashlib, not with the
script's own function); a missing or corrupt part is named and nothing is installed; `install` puts the wheels
(pip --target), the unpacked tree and the plain files where the manifest says, and the installed modules import in
a fresh interpreter; a trim drops exactly its paths and says why; a part is what a 64 MiB transfer leaves beside the
tree that travels with it (tracked and untracked, not ignored), and a part that cannot fit is refused in one line
before anything is downloaded. On a synthetic payload, small enough for every run.

The real vLLM stage (slow; the package index and ~320 MB): staged for the Python of an interpreter that has the GPU
machine's torch (GPU_STAGE_PYTHON, e.g. a Python 3.12 venv with torch==2.11.0 and transformers==5.17.0), installed,
and `from vllm import LLM` run there with nothing else of vLLM's on the path. Skipped without such an interpreter.
"""
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_stage  # noqa: E402


def make_wheel(folder, name, version, files):
    """A minimal valid pure-Python wheel (what pip install --no-index --no-deps --target accepts)."""
    dist = f"{name}-{version}.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    path = Path(folder) / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


@pytest.fixture
def staged(tmp_path):
    """A payload with all three kinds of content, packed into parts of 1 KiB."""
    src = tmp_path / "src"
    for d in ("wheels", "site/treepkg", "files"):
        (src / d).mkdir(parents=True)
    make_wheel(src / "wheels", "wheelpkg", "0.1", {"wheelpkg/__init__.py": "VALUE = 'from the wheel'\n"})
    (src / "site/treepkg/__init__.py").write_text("VALUE = 'from the tree'\n")
    (src / "files/blob.bin").write_bytes(os.urandom(3000))  # incompressible: several parts even under xz
    meta = {"target": "site-out", "files_to": "cache"}
    manifest = gpu_stage.pack("demo", src, tmp_path / "stage", 1 / 1024, True, meta)
    return tmp_path, tmp_path / "stage" / "demo", manifest


def test_parts_fit_and_join_to_the_checksum(staged):
    """Every part is at most the part size, sits in its own folder (one transfer) with the manifest, and the parts
    in order are the payload: their concatenation has the manifest's sha256 and size."""
    _, stage, m = staged
    assert len(m["parts"]) >= 3
    joined = b""
    for i, p in enumerate(m["parts"], 1):
        data = (stage / p["file"]).read_bytes()
        assert p["file"].startswith(f"part-{i}/") and 0 < len(data) <= 1024 and p["bytes"] == len(data)
        assert hashlib.sha256(data).hexdigest() == p["sha256"]
        assert json.loads((stage / f"part-{i}" / "MANIFEST.json").read_text()) == m
        joined += data
    assert len(joined) == m["bytes"] and hashlib.sha256(joined).hexdigest() == m["sha256"]
    assert not list(stage.glob("*.tar*"))  # only the parts are left to transfer


def test_install_puts_everything_in_place_and_it_imports(staged):
    root, stage, m = staged
    res = gpu_stage.install(stage, root=root)
    target = root / "site-out"
    assert res["status"] == "installed" and res["wheels"] == 1 and Path(res["target"]) == target
    assert (root / "cache" / "blob.bin").stat().st_size == 3000
    out = subprocess.run([sys.executable, "-c", "import wheelpkg, treepkg; print(wheelpkg.VALUE, '|', treepkg.VALUE)"],
                         env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True, cwd=root)
    assert out.stdout.strip() == "from the wheel | from the tree", out.stderr
    assert gpu_stage.install(stage, root=root)["status"] == "already installed"  # idempotent: the marker


def test_a_missing_or_corrupt_part_is_named_and_nothing_installed(staged):
    root, stage, m = staged
    part = stage / m["parts"][1]["file"]
    data = part.read_bytes()
    part.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(SystemExit, match="part-2/.* has sha256"):
        gpu_stage.install(stage, root=root)
    part.unlink()
    with pytest.raises(SystemExit, match="missing part-2/"):
        gpu_stage.install(stage, root=root)
    assert not gpu_stage.complete(stage)
    assert not (root / "site-out").exists()


def test_a_stage_for_another_python_is_refused(tmp_path):
    """Binary wheels for another CPython would install and fail at import: install stops first, saying why."""
    (tmp_path / "src" / "files").mkdir(parents=True)
    (tmp_path / "src" / "files" / "x").write_text("x")
    gpu_stage.pack("other", tmp_path / "src", tmp_path / "stage", 1, False,
                   {"target": "site-out", "files_to": "cache", "python": "2.7"})
    with pytest.raises(SystemExit, match="built for CPython 2.7"):
        gpu_stage.install(tmp_path / "stage" / "other", root=tmp_path)


def test_trim_drops_exactly_its_paths_and_says_why(tmp_path):
    wheel = make_wheel(tmp_path, "pkg", "1.0", {"pkg/__init__.py": "", "pkg/big.so": "x" * 100,
                                               "pkg/extra/a.h": "aa", "pkg/extra/b.h": "bbb", "pkg/keep.py": ""})
    trim = {"pkg/big.so": "not loaded", "pkg/extra/": "headers"}
    dropped = gpu_stage.trimmed_tree(wheel, tmp_path / "site", trim)
    assert dropped == {"pkg/big.so": (100, "not loaded"), "pkg/extra/": (5, "headers")}
    kept = sorted(str(p.relative_to(tmp_path / "site")) for p in (tmp_path / "site").rglob("*") if p.is_file())
    assert kept == ["pkg-1.0.dist-info/METADATA", "pkg-1.0.dist-info/RECORD", "pkg-1.0.dist-info/TRIMMED",
                    "pkg-1.0.dist-info/WHEEL", "pkg/__init__.py", "pkg/keep.py"]
    with pytest.raises(SystemExit, match="none of"):  # a rule that matches nothing: the wheel changed
        gpu_stage.trimmed_tree(wheel, tmp_path / "site2", {**trim, "pkg/gone.so": "?"})


def test_the_tree_that_travels_is_tracked_and_untracked_not_ignored(tmp_path):
    """What every transfer carries beside a part: the tracked files and the untracked ones git does not ignore,
    never the ignored ones (a virtual environment, the stages themselves). Sizes written here, summed by hand."""
    def write(name, n):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * n)

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n#\n")  # 11 bytes: untracked, not ignored
    write("tracked/a.py", 1000)
    subprocess.run(["git", "add", "tracked/a.py"], cwd=tmp_path, check=True)
    write("untracked.md", 300)
    write("ignored/big.whl", 5000)
    assert gpu_stage.tree_bytes(tmp_path) == 1000 + 300 + 11


def test_a_part_takes_what_the_tree_leaves_and_one_that_cannot_fit_is_refused(capsys):
    """Default part: 64 MiB less the tree less the 2 MiB margin (18 MiB of tree: 44 MiB; 20.55 MiB: 41.4, rounded
    down to 0.1 MiB). A part asked larger than that, or a tree that leaves less than 4 MiB, is refused with one line
    naming the value (exit code 2)."""
    MiB = 2**20
    assert gpu_stage.part_mib(None, 18 * MiB) == 44.0
    assert gpu_stage.part_mib(None, int(20.55 * MiB)) == 41.4
    assert gpu_stage.part_mib(40, 18 * MiB) == 40
    for asked, tree, says in ((45, 18 * MiB, "--part-mib 45"), (None, 59 * MiB, "leaves 3.0 MiB"),
                              (0, 18 * MiB, "--part-mib 0")):
        with pytest.raises(SystemExit) as stop:
            gpu_stage.part_mib(asked, tree)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_a_stage_that_cannot_fit_refuses_before_downloading(tmp_path):
    """`gpu_stage.py vllm --part-mib 70`: more than a transfer can carry at all; one line, exit code 2, and neither
    the stage folder nor the download cache is made."""
    r = subprocess.run([sys.executable, "scripts/gpu_stage.py", "vllm", "--part-mib", "70", "--out",
                        str(tmp_path / "stage"), "--cache", str(tmp_path / "cache")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "--part-mib 70" in r.stderr, r
    assert not (tmp_path / "stage").exists() and not (tmp_path / "cache").exists()


# --- the real vLLM stage ----------------------------------------------------------------------------------------------
CHECK = r'''
import importlib, json, os, sys
target = sys.argv[1]
os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"   # as rollout.VLLMEngine sets it where flashinfer is absent
import torch, transformers
import vllm
from vllm import LLM, SamplingParams
res = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
       "vllm": vllm.__version__, "vllm_file": vllm.__file__, "modules": {}}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
        res["modules"][name] = "ok"
    except Exception as e:
        res["modules"][name] = f"{type(e).__name__}: {e}"[:300]
from vllm.config import ModelConfig
res["model_config"] = ModelConfig(model=os.path.join(os.getcwd(), "models", "tiny-arith")).architecture
import ctypes, glob   # the CUDA extensions kept: present, and loadable but for the GPU driver
res["extensions"] = {}
for so in ["vllm_flash_attn/_vllm_fa3_C", "_C_stable_libtorch", "vllm_flash_attn/_vllm_fa2_C"]:
    found = glob.glob(os.path.join(target, "vllm", so + ".*so"))
    try:
        res["extensions"][so] = ctypes.CDLL(found[0]) and "loads" if found else "absent"
    except OSError as e:
        res["extensions"][so] = str(e)[:300]
print("RESULT " + json.dumps(res))
'''
# The engine's import path on CUDA (rollout.VLLMEngine, vllm 0.26.0: the V2 model runner, FA3, the cumem allocator
# of sleep mode). Without a GPU driver the cumem allocator fails on libcuda.so.1; everything else must import.
ENGINE_MODULES = [
    "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.executor.abstract",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.sample.sampler", "vllm.v1.worker.gpu.cudagraph_utils", "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama", "vllm.v1.attention.backends.flash_attn", "vllm.device_allocator.cumem",
    "vllm.distributed.parallel_state", "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.core.sched.scheduler", "vllm.compilation.backends",
]


@pytest.mark.smoke
def test_staged_vllm_imports_on_the_gpu_machines_python(tmp_path):
    """vllm 0.26.0 as staged (trimmed, + its 28 wheels), installed by `install` into an empty folder, imports
    `vllm.LLM` on an interpreter with the GPU machine's torch and nothing else of vLLM's; the engine's modules import
    except where they load the CUDA extensions (libcuda.so.1: no GPU driver here)."""
    py = os.environ.get("GPU_STAGE_PYTHON")
    if not py:
        pytest.skip("set GPU_STAGE_PYTHON to a Python 3.12 with torch==2.11.0 and transformers==5.17.0 (the GPU "
                    "machine's); the CPU development machine's Python 3.11 cannot load the cp312 wheels")
    version = subprocess.run([py, "-c", "import sys, torch; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                             capture_output=True, text=True).stdout.strip()
    if not version:
        pytest.skip(f"{py} cannot import torch")
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(tmp_path),
                            "sniffio==1.3.1"], capture_output=True, text=True, timeout=120)
    if probe.returncode:
        pytest.skip(f"the package index is unreachable: {probe.stderr.strip()[-200:]}")
    r = subprocess.run([sys.executable, "scripts/gpu_stage.py", "vllm", "--python-version", version,
                        "--out", str(tmp_path / "stage")], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    stage = tmp_path / "stage" / "vllm"
    m = gpu_stage.read_manifest(stage)
    assert all(p["bytes"] <= m["part_mib"] * 2**20 for p in m["parts"]) and len(m["wheels"]) == 28
    assert m["part_mib"] + gpu_stage.MARGIN_MIB + gpu_stage.tree_bytes() / 2**20 <= 64  # each part fits one transfer
    target = tmp_path / "site"
    r = subprocess.run([py, "scripts/gpu_stage.py", "install", str(stage), "--target", str(target)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([py, "-s", "-c", CHECK, str(target), *ENGINE_MODULES], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(target)))
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:]) \
        if "RESULT " in r.stdout else pytest.fail(r.stderr[-3000:])
    assert res["vllm"] == "0.26.0" and res["vllm_file"].startswith(str(target)), res
    failed = {k: v for k, v in res["modules"].items() if v != "ok"}
    assert all("libcuda.so.1" in v for v in failed.values()), failed
    assert res["model_config"] == "LlamaForCausalLM"  # the tiny model's config parses under this transformers
    ext = res["extensions"]
    assert ext["vllm_flash_attn/_vllm_fa2_C"] == "absent", ext  # trimmed
    assert all("libcuda.so.1" in ext[k] for k in ("vllm_flash_attn/_vllm_fa3_C", "_C_stable_libtorch")), ext
