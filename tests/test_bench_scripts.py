"""bench/ holds the maintained benchmarks, and nothing that no longer runs: every script imports
against today's product, and no script or patch hides among the results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One process for all (and not this one: bench/onnx.py would shadow the onnx package for every test
# after this one); the path put back before each script, since some take bench/ off it.
_IMPORT_ALL = """
import importlib.util, sys, pathlib
bench = pathlib.Path(sys.argv[1])
failed = []
for p in sorted(bench.glob("*.py")):
    sys.path[:0] = [str(bench), str(bench.parent)]
    spec = importlib.util.spec_from_file_location(f"bench_script_{p.stem}", p)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException as e:
        failed.append(f"{p.name}: {e!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_bench_script_imports():
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(ROOT / "bench")], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_no_script_or_patch_among_the_results():
    tracked = subprocess.run(["git", "ls-files", "bench/results"], capture_output=True, text=True, cwd=ROOT).stdout
    assert [f for f in tracked.split() if f.endswith((".py", ".patch"))] == []
