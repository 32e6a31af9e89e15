#!/bin/bash
python3 - <<'PY'
from pathlib import Path
p = Path("/app/calc.py")
src = p.read_text()
p.write_text(src.replace("def subtract(a, b):\n    return a + b", "def subtract(a, b):\n    return a - b"))
PY
