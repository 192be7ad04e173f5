"""integrations/verl_bandpo.py against the real verl 0.9.1, run in its own environment.

verl 0.9.1 pins transformers<5.11 (ours: 5.19.0), so it lives in .venv-verl (scripts/bootstrap_verl.sh, run by
`make venv`). This test runs tests/verl_bandpo_checks.py (the claims, listed in its docstring) under .venv-verl's
pytest in one subprocess and reports its output. Outside CI a missing .venv-verl skips, under CI (CI=true) it fails.
"""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERL_PY = os.path.join(ROOT, ".venv-verl", "bin", "python")


def _verl_checks(tmp):
    """tests/verl_bandpo_checks.py under .venv-verl's pytest -> the run (None where .venv-verl is missing)."""
    if not os.path.exists(VERL_PY):
        return None
    cmd = [VERL_PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/verl_bandpo_checks.py"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)  # a hang guard, not a speed check


@pytest.mark.smoke
@pytest.mark.ahead.with_args(_verl_checks, cpu_s=17)
def test_verl_bandpo_in_verl_env(ahead):
    out = ahead.result(_verl_checks)
    if out is None:
        msg = ".venv-verl is missing: run `bash scripts/bootstrap_verl.sh` (or `make venv`)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    assert out.returncode == 0, out.stdout[-10000:] + out.stderr[-4000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-3000:]
