#!/bin/bash
set -e
cd /app
sed -i 's/return year % 4 == 0/return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)/' calendar_utils.py
