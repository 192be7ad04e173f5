"""scripts/gpu_check.py as a process: what it records when it is stopped from outside, and its exit code when
nothing it was asked to run ran. Real subprocesses of the check's CPU mode (`--device cpu --quick`), real signals.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(out, *flags, env=None):
    env = {k: v for k, v in (env or os.environ).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out),
                             *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_keeps_what_the_running_section_had_measured(tmp_path):
    """An outer `timeout` stops the check with SIGTERM. The section running then is recorded as stopped with what
    it had written so far (its partial file: here the pack section's shape and FLOPs, written before its first
    setting), its seconds so far, not 0, and its log's tail; the check exits 143 and its processes are gone."""
    proc = check(tmp_path, "--only", "pack")
    partial, deadline = tmp_path / "sections" / "pack.json", time.time() + 600  # a hang guard
    while time.time() < deadline and proc.poll() is None:
        if partial.is_file() and "real_tokens" in partial.read_text():
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    measured = json.loads(partial.read_text())
    t_signal = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    sec = json.loads((tmp_path / "report.json").read_text())["sections"]["pack"]
    assert sec["status"] == "timeout" and "SIGTERM" in sec["error"]
    assert measured["real_tokens"] > 0 and measured["model_tflops_per_update"] > 0
    assert {k: sec[k] for k in measured if k != "settings"} == {k: v for k, v in measured.items() if k != "settings"}
    assert sec["seconds"] > 0 and sec["log_tail"] is not None and (tmp_path / sec["log"]).is_file()
    assert time.time() - t_signal < 60
    assert "## pack: timeout" in (tmp_path / "report.md").read_text()


def test_nothing_requested_ran_is_a_failure(tmp_path):
    """`--only sleep,train_vllm` where vLLM cannot be imported: both sections skip, so nothing that was asked for
    ran; the check says so in one line on stderr and exits non-zero. vLLM is made unimportable by a package of its
    name first on PYTHONPATH whose import fails (a broken install reads the same to the check)."""
    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('vllm is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(shadow.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = check(tmp_path / "out", "--only", "sleep,train_vllm", env=env)
    out, err = proc.communicate(timeout=600)  # a hang guard: two section processes importing torch
    assert proc.returncode == 1, (out, err)
    assert err.count("\n") == 1 and "none of the requested sections ran" in err, err
    assert "sleep: vLLM not importable" in err and "train_vllm: vLLM not importable" in err, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {n: s["status"] for n, s in report["sections"].items()} == {"sleep": "skipped", "train_vllm": "skipped"}
