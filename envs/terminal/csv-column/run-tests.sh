#!/bin/bash
# Upstream Terminal-Bench runner (installs pytest with uv from the network); agentrl runs
# tests/test_outputs.py itself with the image's pytest, offline.
pytest $TEST_DIR/test_outputs.py -rA
