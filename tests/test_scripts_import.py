"""Every script of scripts/, benchmarks/, experiments/ and derivations/ still finds what it imports, so a module that
moves (verify_pool.py into machinery/) cannot break a script no test runs.

One fresh interpreter imports each script as `python <script>` would (its folder first on sys.path, `__name__` not
"__main__", so nothing runs): the imports at the top of a file execute. None has a side effect beyond sys.path,
os.environ defaults and matplotlib's backend, so one process serves them all. The imports inside functions (the
lazy ones: vLLM, matplotlib, a sibling script) are checked without running them: each module must be found, and a
name taken `from` one of the project's own modules must exist in it. The shell scripts beside them (and recipes/)
must parse, and every .py file they name must exist.
"""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("scripts", "benchmarks", "experiments", "derivations")

CHILD = r'''
import ast, importlib, importlib.util, json, os, sys
root, scripts = sys.argv[1], sys.argv[2:]
sys.path.insert(0, root)
from machinery import precision  # noqa: F401  (conftest's order: its oneMKL warm-up before any float math)
problems = []
for path in scripts:                      # the imports at the top of each file, executed
    name, folder = os.path.basename(path)[:-3], os.path.dirname(path)
    sys.path.insert(0, folder)            # as `python path` puts the script's folder first
    try:
        if name not in sys.modules:       # a sibling already imported by another script is the same module
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except BaseException as e:            # noqa: B036  (SystemExit too: a script that exits on import is broken)
        sys.modules.pop(name, None)
        problems.append(f"{os.path.relpath(path, root)}: import fails: {type(e).__name__}: {e}")

def own(module):                          # a module of this repository (not an installed package)?
    spec = importlib.util.find_spec(module.split(".")[0])
    return spec is not None and (spec.origin or "").startswith(root) and ".venv" not in (spec.origin or "")

for path in scripts:                      # every import statement, those inside functions too, resolved
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, attr in wanted:
            where = f"{os.path.relpath(path, root)}:{node.lineno}"
            if importlib.util.find_spec(module.split(".")[0]) is None:
                problems.append(f"{where}: no module {module!r}")
            elif own(module):             # the project's own: the full dotted path, and the name taken from it
                try:
                    found = importlib.import_module(module)
                except BaseException as e:  # noqa: B036
                    problems.append(f"{where}: import {module} fails: {type(e).__name__}: {e}")
                    continue
                if attr and attr != "*" and not hasattr(found, attr) and not (
                        hasattr(found, "__path__") and importlib.util.find_spec(f"{module}.{attr}")):  # a submodule
                    problems.append(f"{where}: {module!r} has no {attr!r}")
print("PROBLEMS " + json.dumps(problems))
'''


def scripts():
    return sorted(p for f in FOLDERS for p in glob.glob(os.path.join(ROOT, f, "*.py")))


def _import_every_script(tmp):
    from test_train import env  # as from a shell
    return subprocess.run([sys.executable, "-c", CHILD, ROOT, *scripts()], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.ahead.with_args(_import_every_script, cpu_s=7)
def test_every_script_finds_what_it_imports(ahead):
    paths = scripts()
    assert len(paths) > 30 and os.path.join(ROOT, "benchmarks", "bench_reward.py") in paths
    out = ahead.result(_import_every_script)
    line = next((x for x in out.stdout.splitlines() if x.startswith("PROBLEMS ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    problems = json.loads(line[len("PROBLEMS "):])
    assert not problems, "\n".join(problems)


def test_shell_scripts_parse_and_name_files_that_exist():
    shells = sorted(p for f in (*FOLDERS, "recipes") for p in glob.glob(os.path.join(ROOT, f, "*.sh")))
    assert shells
    problems = []
    for path in shells:
        rel = os.path.relpath(path, ROOT)
        check = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
        if check.returncode:
            problems.append(f"{rel}: {check.stderr.strip()}")
        text = open(path).read()
        for named in sorted(set(re.findall(r"[\w./-]+\.py\b", text))):   # a bare name may sit in any folder
            where = [named.removeprefix("./")] if "/" in named else [named] + [f"{f}/{named}" for f in FOLDERS]
            if not any(os.path.isfile(os.path.join(ROOT, w)) for w in where):
                problems.append(f"{rel}: names {named}, which is not in the tree")
    assert not problems, "\n".join(problems)
