#!/bin/bash
python3 - <<'PY'
import csv
with open("/app/people.csv") as f, open("/app/cities.txt", "w") as out:
    for row in csv.DictReader(f):
        out.write(row["city"] + "\n")
PY
