"""bench/pipeline_rounds.py at toy shapes on CPU: every variant runs and is reported, so its
first GPU run is not its first run (the numbers mean nothing here)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pipeline_rounds_toy(tmp_path):
    out = tmp_path / "rounds.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "bench/pipeline_rounds.py", "--toy", "--rounds", "2",
                           "--repeats", "1", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == [
        "cond, all valid", "steady, all valid", "cond, half idle", "masked, half idle"]
    assert all(r["ms_per_round"] > 0 and r["dtoh_copies_per_round"] >= 0
               for r in result["rows"])
    assert "reproduce: PYTHONPATH=. python bench/pipeline_rounds.py" in done.stdout
    bad = subprocess.run([sys.executable, "bench/pipeline_rounds.py", "--rounds", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")
