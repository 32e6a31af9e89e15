#!/bin/bash
# Harbor verifier: pytest on the hidden tests, reward as JSON.
mkdir -p /logs/verifier
if python3 -m pytest -q -p no:cacheprovider --rootdir=/tests --confcutdir=/tests -o addopts="" /tests/test_stats.py; then
  echo '{"reward": 1.0}' > /logs/verifier/reward.json
else
  echo '{"reward": 0.0}' > /logs/verifier/reward.json
fi
