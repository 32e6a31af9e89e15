#!/bin/bash
python3 - <<'PY'
import csv
with open("/app/sales.csv", newline="") as f:
    total = sum(float(r["amount"]) for r in csv.DictReader(f))
with open("/app/total.txt", "w") as f:
    f.write(f"{total:g}\n")
PY
