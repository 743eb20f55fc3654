#!/bin/bash
set -e
cd /app
sed -i 's/1.4.2/1.5.0/' pkg/__init__.py setup.cfg && sed -i 's/^## 1.4.2$/## 1.5.0\n\n## 1.4.2/' CHANGELOG.md
