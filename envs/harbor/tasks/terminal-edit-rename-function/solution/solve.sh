#!/bin/bash
set -e
cd /app
sed -i 's/get_user/fetch_user/g' app/*.py
