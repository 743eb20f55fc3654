#!/bin/bash
set -e
cd /app
sed -i 's/return line.split(",")/return [f.strip() for f in line.split(",")]/' records.py
