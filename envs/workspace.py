"""A per-episode workspace of files carried into and out of sandbox runs, and how a run's problems are classed."""
from __future__ import annotations

import base64
import json
import posixpath
import shlex
from dataclasses import dataclass, field

from megatron_rl.envs.sandbox.base import Limits, Sandbox, SandboxResult

_RESERVED = ".mrl_"
_DUMP = (
    "import os,json,base64\n"
    "out={};total=0\n"
    "for d,ds,fs in os.walk('.'):\n"
    " ds[:]=sorted(x for x in ds if not os.path.islink(os.path.join(d,x)) and x!='__pycache__')\n"
    " for f in sorted(fs):\n"
    "  p=os.path.normpath(os.path.join(d,f))\n"
    "  if p.startswith('.mrl_') or os.path.islink(p) or not os.path.isfile(p): continue\n"
    "  total+=os.path.getsize(p)\n"
    "  if total>MAXB or len(out)>=MAXF: raise SystemExit(3)\n"
    "  out[p]=base64.b64encode(open(p,'rb').read()).decode()\n"
    "json.dump(out,open('.mrl_ws.json','w'))\n"
)


def safe_relpath(path: str) -> str | None:
    """Normalise a model-given relative path; None if it is absolute, escapes the workspace or is reserved."""
    if not isinstance(path, str) or not path or "\x00" in path or path.startswith("/"):
        return None
    p = posixpath.normpath(path)
    if p in (".", "") or p.startswith("../") or p == ".." or p.startswith(_RESERVED):
        return None
    return p


@dataclass
class Workspace:
    """A scratch directory that survives across turns as files in the worker, carried into each sandbox run
    and collected back after it (new, changed and deleted files alike). Regular files only: symlinks, empty
    directories and permission bits are not carried (run scripts with `sh x.sh` / `python3 x.py`)."""

    files: dict[str, bytes] = field(default_factory=dict)
    """Relative path -> content."""
    max_bytes: int = 1 << 20
    """Most bytes over all files; a run that leaves more keeps the previous files."""
    max_files: int = 256
    """Most files."""

    def write(self, path: str, content: str | bytes) -> str | None:
        """Write a file; return an error message (for the model) or None."""
        p = safe_relpath(path)
        if p is None:
            return f"invalid path {path!r}: use a relative path inside the workspace"
        data = content.encode() if isinstance(content, str) else content
        size = sum(len(v) for k, v in self.files.items() if k != p) + len(data)
        if size > self.max_bytes or (p not in self.files and len(self.files) >= self.max_files):
            return f"workspace full (limit {self.max_bytes} bytes, {self.max_files} files)"
        self.files[p] = data
        return None

    def read(self, path: str) -> bytes | None:
        p = safe_relpath(path)
        return None if p is None else self.files.get(p)

    def run(self, sandbox: Sandbox, command: str, limits: Limits | None = None,
            extra_files: dict[str, str | bytes] | None = None, sockets: dict | None = None
            ) -> tuple[SandboxResult, str | None]:
        """Run a shell `command` with the workspace as the scratch directory, then take back its files.

        Returns the sandbox result and an error message when the files could not be collected (the
        workspace then stays as it was). `extra_files` are present for this run only; `sockets` go to the
        sandbox's `run` (Unix sockets the command reaches, bubblewrap only).
        """
        files: dict[str, str | bytes] = dict(self.files)
        files.update(extra_files or {})
        files[".mrl_cmd.sh"] = command
        dump = _DUMP.replace("MAXB", str(self.max_bytes)).replace("MAXF", str(self.max_files))
        script = f"sh .mrl_cmd.sh; rc=$?; python3 -I -S -c {shlex.quote(dump)} || exit 125; exit $rc"
        kw = {"sockets": sockets} if sockets else {}
        result = sandbox.run(script, files=files, limits=limits, collect=[".mrl_ws.json"], **kw)
        err = self._take_back(result.files.get(".mrl_ws.json"), set(extra_files or {}))
        return result, err

    def _take_back(self, manifest: bytes | None, drop: set[str]) -> str | None:
        if manifest is None:
            return "workspace files could not be collected (killed, or too large)"
        try:
            obj = json.loads(manifest)
            new = {}
            for k, v in obj.items():
                p = safe_relpath(k)
                if p is not None and p not in drop:
                    new[p] = base64.b64decode(v, validate=True)
        except (ValueError, AttributeError, TypeError, RecursionError):
            return "workspace files could not be collected (corrupt manifest)"
        if sum(map(len, new.values())) > self.max_bytes or len(new) > self.max_files:
            return "workspace over its size limit; changes dropped"
        self.files = new
        return None


def sandbox_problem(result: SandboxResult) -> tuple[str, str] | None:
    """(reason, status) when a run did not complete normally, None when it did. A limit the program hit is
    the model's doing (status ok: a zero reward); a 'setup' violation is the sandbox's (sandbox_error)."""
    if "setup" in result.violations:
        return f"sandbox setup failed: {result.stderr[-300:]}", "sandbox_error"
    if result.violations:
        return f"sandbox limit hit: {', '.join(result.violations)}", "ok"
    return None
