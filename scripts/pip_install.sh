# Sourced by scripts/setup.sh and scripts/setup_vllm.sh (needs log()): installs Python packages into a venv.
#   py_install PY ARGS...    like `PY -m pip install -q ARGS...`
# With uv ($UV, the project venv's: scripts/setup.sh puts it there first) when it is there: it downloads and
# unpacks in parallel (vLLM's 3.5 GB venv in ~30 s from an empty cache on 2 cores, against pip's ~5 min). uv reads
# no pip.conf, so pip's own settings on this machine (index-url, extra-index-url, find-links, constraint; global or
# from PIP_* variables) are handed to it, with pip's rule of the best version over all indexes. Without uv, or with
# MRL_NO_UV=1: pip.

# pip warns once per package about index folders this machine's pip config names but lacks; keep real errors
quiet_pip() { "$@" 2> >(grep -v "WARNING: Location 'file:" >&2); }

# the values of pip setting KEY (`pip config list`, global or environment), one a line
pip_setting() { "$1" -m pip config list 2>/dev/null | sed -n "s/^[^=]*[.]$2='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u; }

py_install() {
  local py=$1; shift
  if [ "${MRL_NO_UV:-0}" = 1 ] || [ ! -x "${UV:-}" ]; then
    quiet_pip "$py" -m pip install -q "$@"; return
  fi
  local args=(--python "$py" --index-strategy unsafe-best-match) v
  for v in $(pip_setting "$py" index-url); do args+=(--index-url "$v"); done
  for v in $(pip_setting "$py" extra-index-url); do args+=(--extra-index-url "$v"); done
  for v in $(pip_setting "$py" find-links); do args+=(--find-links "$v"); done
  for v in $(pip_setting "$py" constraint); do args+=(--constraint "$v"); done
  "$UV" pip install -q "${args[@]}" "$@"
}
