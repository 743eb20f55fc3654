#!/bin/bash
set -e
cd /app
sed -i 's/def join_names(names):/def join_names(names, sep=", "):/; s/return ", ".join/return sep.join/' names.py && sed -i 's/join_names(team)/join_names(team, sep="; ")/' report.py
