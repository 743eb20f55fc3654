#!/bin/bash
set -e
cd /app
printf 'def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n' > mathutils.py
