#!/bin/bash
# Look, then act on what was seen.
cat /app/code.txt
echo "$(cat /app/code.txt)" > /app/answer.txt
