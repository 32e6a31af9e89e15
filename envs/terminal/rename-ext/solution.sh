#!/bin/bash
cd /app/docs
for f in *.txt; do
  [ -e "$f" ] || continue
  mv -- "$f" "${f%.txt}.md"
done
