#!/bin/bash
# Look, then act on what was seen: the note holds the command to run.
cat /app/note.txt
bash /app/note.txt
