"""scripts/gpu_drift.py, the SmolLM2 drift protocol's runner for a machine lent for minutes, on this CPU with its
--smoke spec (the toy model): its processes, their time limit, and the whole seeds it hands to --merge-into."""
import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import drift  # noqa: E402


@pytest.mark.slow   # a repeat through two processes of tests/test_drift.py's --minutes and --merge-into tests
def test_smoke_run_hands_whole_seeds_to_merge(tmp_path):
    """Two processes, --minutes 0.05 (3 s, less than a process's imports): each runs the first of its seeds (0
    and 1; the first always starts) and not its second (2, 3); both seeds are whole (1 branch point x 2 arms),
    copied to OUT/seeds, and --merge-into takes them. The guard (--grace 600) is a hang guard only here.
    The plan's spec is the plan's numbers (checked against plan.md's text, not against the script)."""
    out, run = tmp_path / "out", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "scripts/gpu_drift.py", "--smoke", "--jobs", "2", "--minutes", "0.05",
                           "--grace", "600", "--out", str(out), "--run", str(run)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# gpu_drift: 2 whole seeds") and "- seeds: [0, 1]" in summary
    assert "stopped at the guard: none" in summary and "exit codes: [0, 0]" in summary
    assert sorted(os.listdir(out / "seeds")) == ["s0.jsonl", "s1.jsonl"]
    for i in (0, 1):
        assert "stopping before seed" in (out / "logs" / f"drift-{i}.log").read_text()
    target = tmp_path / "pairs.jsonl.gz"
    assert drift.merge_into(str(out), str(target), branches=1, every=1)[:2] == ([0, 1], 4)
    with gzip.open(target, "rt") as f:
        assert {(r["seed"], r["arm"]) for r in map(json.loads, f)} == {
            (0, "clip"), (0, "noclip"), (1, "clip"), (1, "noclip")}


def test_plan_spec_is_the_plans():
    """The seeds, branch points, arms and train flags of the plan's run as plan.md writes them."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_drift
    plan = open(os.path.join(ROOT, "experiments", "results", "drift-smollm2", "plan.md")).read()
    spec = gpu_drift.PLAN
    assert "**K = 12 seeds (0-11) x 5 branch points (rollouts 0-4)**" in plan
    assert "**Three arms**: clip, bandkl, noclip" in plan
    assert list(spec["seeds"]) == list(range(12)) and spec["branches"] == 5 and spec["arms"] == "clip,bandkl,noclip"
    assert f"A={spec['arms']}" in plan
    flags = " ".join(plan[plan.index('T="') + 3:plan.index('"', plan.index('T="') + 3)].split())
    assert flags == " ".join(spec["train"])
    assert f"--probe-prompts {spec['probe'][0]} --probe-samples {spec['probe'][1]}" in plan
