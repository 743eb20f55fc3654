#!/bin/bash
set -e
cd /app
sqlite3 app.db <<'EOF'
ALTER TABLE users ADD COLUMN domain TEXT;
UPDATE users SET email = lower(trim(email));
UPDATE users SET domain = substr(email, instr(email, '@') + 1);
CREATE UNIQUE INDEX users_email_idx ON users(email);
EOF
