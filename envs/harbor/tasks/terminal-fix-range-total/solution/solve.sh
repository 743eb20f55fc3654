#!/bin/bash
set -e
cd /app
sed -i 's/counts\[start:end\]/counts[start:end + 1]/' inventory.py
