#!/bin/bash
set -e
cd /app
sed -i 's/return "_".join(words)/return "-".join(w.lower() for w in words)/' slug.py
