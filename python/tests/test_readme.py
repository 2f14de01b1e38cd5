"""The README's Python script (issue 48's acceptance), run exactly as the README shows it, in a
fresh interpreter: it asserts the losses against PyTorch's within 1e-5 and the outputs after
load_state_dict itself. Needs torch and transformers: fails (never skips) without them."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- readme-script:[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no readme-script block"
    return m.group(1)


def test_readme_script_is_at_most_10_lines():
    lines = [line for line in readme_script().splitlines() if line.strip()]
    assert len(lines) <= 10, len(lines)


def test_readme_script_runs():
    out = subprocess.run([sys.executable, "-c", readme_script()], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    printed = [line for line in out.stdout.splitlines() if line.startswith(("logits ", "output "))]
    assert len(printed) == 2, out.stdout
