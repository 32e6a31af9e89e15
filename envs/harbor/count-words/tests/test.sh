#!/bin/bash
mkdir -p /logs/verifier
want=23  # fixed: the agent may edit text.txt
got=$(tr -d ' \n' < /app/count.txt 2>/dev/null)
if [ -n "$got" ] && [ "$got" = "$want" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
