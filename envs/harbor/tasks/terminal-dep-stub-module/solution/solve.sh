#!/bin/bash
set -e
cd /app
printf 'def km_to_miles(km):\n    return km / 1.609344\n\n\ndef miles_to_km(mi):\n    return mi * 1.609344\n' > conversions.py
