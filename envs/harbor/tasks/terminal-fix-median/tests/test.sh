#!/bin/bash
# The reward (1: every pristine test ran and passed, else 0) goes to /logs/verifier/reward.txt.
mkdir -p /logs/verifier
cd /app
if python3 -I -S /tests/run_tests.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
