#!/bin/bash
# Run as Terminal-Bench's harness does: `bash /tests/run-tests.sh` in the WORKDIR with TEST_DIR=/tests,
# scored by the pytest parser (-rA prints the short test summary). Upstream's boilerplate installs
# pytest with uv from astral.sh at this point; this task bakes pytest into its image instead.
pytest $TEST_DIR/test_outputs.py -rA
