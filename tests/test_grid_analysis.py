"""benchmarks/grid_analysis.py reproduces docs/PERFORMANCE.md's "where the time goes" table from
the committed H200 grid run (the script is the doc's source; this keeps the two in step)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs" / "grid" / "grid-8e63f5b.json"


def test_grid_analysis_reproduces_the_committed_table():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grid_analysis.py"),
                             str(RUN)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| shape")]
    assert len(rows) == 32
    performance = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    for row in rows:  # every row, byte for byte, is the one the doc shows
        assert row in performance, row
