#!/bin/bash
cut -d' ' -f1 /app/access.log | sort | uniq -c | sort -rn | head -3 | sed 's/^ *//' > /app/top3.txt
