#!/bin/bash
# Runs the checks in test_outputs.py; the reward (1 pass, 0 fail) goes to /logs/verifier/reward.txt.
mkdir -p /logs/verifier
cd /app
if python3 -I /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
