#!/bin/bash
tr 'A-Z' 'a-z' < /app/words.txt | tr -c 'a-z' '\n' | grep -v '^$' | LC_ALL=C sort -u > /app/unique.txt
