#!/usr/bin/env bash
# The sandbox tests (attack suite included) again as a normal user: uid MRL_TEST_UID (default 65534, nobody)
# via setpriv, with a HOME/TMPDIR of its own and a copy of the sources (the checkout may not be readable by
# that user), all in a temp folder removed afterwards. Root-only tests skip themselves with a reason; the
# normal-user fallbacks (RLIMIT_NPROC inside the run's user namespace, scratch size checks, notes) run here.
# scripts/test.sh calls this after the main pass when run as root; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
TEST_UID=${MRL_TEST_UID:-65534}
PY=${MRL_VENV:-$REPO/.venv}/bin/python
TESTS=(tests/envs/test_sandbox.py tests/envs/test_sandbox_pool.py tests/envs/test_sandbox_rewards.py
       tests/envs/test_sandbox_image.py tests/envs/test_agent_episode.py tests/envs/test_sandbox_cgroup2.py
       tests/envs/test_sandbox_zygote.py tests/envs/test_sandbox_spawn.py tests/envs/test_sandbox_image_multiproc.py)

log() { printf '[test-unprivileged] %s\n' "$*" >&2; }
if [ "$(id -u)" != 0 ]; then log "not root: the main pass already ran as a normal user"; exit 0; fi
command -v setpriv >/dev/null || { log "setpriv (util-linux) is needed"; exit 1; }

tmp=$(mktemp -d /tmp/mrl-unprivileged-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
mkdir -m 700 "$tmp/home" && chown "$TEST_UID:$TEST_UID" "$tmp/home"
mkdir "$tmp/src" && cp -r envs megatron_rl kernels tools tests configs pytest.ini "$tmp/src/"
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
chmod -R a+rX "$tmp/src"

as_user() {  # as_user EXTRA_PYTHONPATH CMD...
  local pp="$tmp/src${1:+:$1}"
  shift
  (cd "$tmp/src" && setpriv --reuid="$TEST_UID" --regid="$TEST_UID" --clear-groups \
     env -i PATH=/usr/bin:/bin HOME="$tmp/home" TMPDIR="$tmp/home" LANG=C.UTF-8 PYTHONPATH="$pp" "$@")
}

# The venv's interpreter if that user can run it (a pyenv/conda base under /root usually is not readable),
# else the system python3 of the same version with the venv's packages.
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if as_user "" "$PY" -c 'import pytest' 2>/dev/null; then
  run=(as_user "" "$PY")
elif as_user "$site" "/usr/bin/python$ver" -c 'import pytest' 2>/dev/null; then
  run=(as_user "$site" "/usr/bin/python$ver")
else
  log "uid $TEST_UID can run neither $PY nor /usr/bin/python$ver with $site: make one readable"; exit 1
fi
log "running ${TESTS[*]} as uid $TEST_UID with ${run[2]}"
"${run[@]}" -m pytest -p no:cacheprovider -q "${TESTS[@]}" "$@"
