"""Per-domain sandbox images: a spec (Debian and pip packages, files, env, workdir), content-addressed, built
without root into ONE file on the shared filesystem (squashfs when `mksquashfs` is installed, else a tar).

An image is a layer over the node's own Debian system: everything it installs lives under `/usr/local` (and
`/opt`), which the sandbox mounts read-only over the host's (`envs.sandbox.bwrap`: `--ro-bind`; Apptainer:
`--overlay image.sqfs:ro`, `envs.sandbox.apptainer`). Debian packages are fetched with `apt-get download` (or
taken from local .deb folders, e.g. /var/cache/apt/archives) and unpacked with `dpkg-deb -x`; their `usr/`
(and `bin/`, `lib/`) is relocated to `usr/local/`, `usr/lib/python3/dist-packages` to the Python site folder
of `/usr/local`; `etc/` and `var/` of a package are dropped (listed in the manifest). Pip requirements go
in with `pip install --target` (a fresh folder, then moved to /usr/local/lib/python3.X/dist-packages, a folder
on the host python's path; console scripts to /usr/local/bin).

Content address: sha256 of the canonical spec, the format version, the base (host Debian release, machine,
python version) and the bytes of every local input (COPY'd files, local .debs, wheel folders). Same spec ->
same digest -> the same file `<store>/<digest>.sqfs`; any change -> a new digest. Named packages are pinned by
their spec string (`name=version` pins the content; a bare name takes what apt/pip resolves at build time).

THREAT MODEL: the spec is trusted (the domain's author wrote it, or a parsed Harbor Dockerfile subset), the
packages are trusted as the site's apt/pip sources are; the build runs package maintainer scripts never
(`dpkg-deb -x` only unpacks) and pip's build backends of sdists (prefer wheels). The image is mounted
read-only: a sandboxed program cannot change it for later runs. Dependencies the base lacks are added by
apt's resolver (`resolve_apt`), those of local .debs (`debs`, `deb_dirs`) too; the resolved set depends on
the apt sources at build time (pin versions for a fixed image; `apt_deps: false` turns resolution off).
The build is confined to its folder although packages and task folders come from task authors (Harbor tasks,
local .deb folders): every path it writes is opened one component at a time without following links (openat,
O_NOFOLLOW), so a link a package put in the image never sends a later package's files, pip's target or a
`files:` entry anywhere else (the build stops, naming the package or entry, rather than write through a link);
a folder is never replaced by a file or link, so /usr/local and /opt (what the sandbox mounts) stay real
folders; a symlink whose target climbs out of its package or of the image with `..` is refused at unpack,
naming the package (`check_link`); devices and FIFOs in a package are refused.
Not covered: absolute symlinks inside a package are kept as they are (not rewritten to /usr/local): they
resolve inside the sandbox's own root (e.g. /usr/bin/python3 -> /usr/bin/python3.11), which the builder never
follows; a package's maintainer scripts are not run, so what they would set up is missing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import platform
import posixpath
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field

from megatron_rl.config import ConfigError

FORMAT = 1
MANIFEST = ".image.json"
HOST_PYTHON = "/usr/bin/python3"
_ROOT_DIRS = ("usr/local", "opt")
"""Where an image's files may live (what the sandbox mounts over the host)."""
_PKG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]*(=[A-Za-z0-9.:~+_-]+)?$")


class ImageBuildError(RuntimeError):
    """An image could not be built; the message names the package or file and the fix."""


@dataclass
class ImageSpec:
    """What a domain's sandbox image holds (YAML keys of an image spec file; unknown keys are refused)."""

    name: str = ""
    """A human label (logs and the manifest); not part of the content address."""
    base: str = "host"
    """The system the layer goes over: 'host' (this node's Debian /usr), or a Debian-based image tag such as
    debian:bookworm / python:3.11-slim recorded as asked (the sandbox still uses the node's /usr)."""
    apt: list[str] = field(default_factory=list)
    """Debian packages (`name` or `name=version`), fetched with apt-get download and unpacked rootless."""
    debs: list[str] = field(default_factory=list)
    """Local .deb files to unpack (hashed by content)."""
    deb_dirs: list[str] = field(default_factory=lambda: ["/var/cache/apt/archives"])
    """Folders searched for `<name>_<version>_<arch>.deb` before apt-get download (offline builds)."""
    apt_sources: list[str] = field(default_factory=list)
    """sources.list lines (e.g. `deb [trusted=yes] file:/srv/repo ./`) used instead of the host's to resolve and
    fetch the apt packages; [] = the host's apt sources (after its `apt-get update`)."""
    apt_deps: bool = True
    """Add every dependency the base lacks (apt's resolver, `apt-get install -s`); False = the listed only."""
    pip: list[str] = field(default_factory=list)
    """Pip requirements installed with `pip install --target` into /usr/local's site folder."""
    pip_find_links: list[str] = field(default_factory=list)
    """Local folders of wheels for pip (hashed by content); with pip_no_index, the only source."""
    pip_no_index: bool = False
    """Do not use PyPI (offline sites: wheels from pip_find_links only)."""
    files: dict[str, str] = field(default_factory=dict)
    """Destination in the image (under /usr/local or /opt) -> a host file or folder to copy there."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of every program run in the image."""
    workdir: str = "/work"
    """The directory programs start in: /work (the run's scratch) or a folder of the image under /opt."""

    def validate(self) -> None:
        for pkg in self.apt:
            if not _PKG.match(pkg):
                raise ConfigError(f"image {self.name!r}: apt package {pkg!r} is not `name` or `name=version`")
        for path in self.debs + self.pip_find_links:
            if not os.path.exists(path):
                raise ConfigError(f"image {self.name!r}: {path!r} does not exist")
        for dest, src in self.files.items():
            image_path(dest, f"image {self.name!r}: files")
            if not os.path.exists(src):
                raise ConfigError(f"image {self.name!r}: files[{dest!r}] source {src!r} does not exist")
        if self.workdir != "/work":
            image_path(self.workdir, f"image {self.name!r}: workdir", root_dirs=("opt",))
        for k in self.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise ConfigError(f"image {self.name!r}: env name {k!r} is not a valid variable name")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "image") -> ImageSpec:
        from megatron_rl.config import from_dict

        return from_dict(cls, d, prefix=where)

    @classmethod
    def load(cls, path: str) -> ImageSpec:
        """An image spec YAML file; relative paths in it are relative to the file's folder."""
        import yaml

        with open(path) as f:
            d = yaml.safe_load(f) or {}
        if not isinstance(d, dict):
            raise ConfigError(f"image spec {path}: expected a mapping of ImageSpec keys")
        here = os.path.dirname(os.path.abspath(path))
        fix = lambda p: p if not isinstance(p, str) or os.path.isabs(p) else os.path.join(here, p)  # noqa: E731
        for key in ("debs", "deb_dirs", "pip_find_links"):
            if isinstance(d.get(key), list):
                d[key] = [fix(p) for p in d[key]]
        if isinstance(d.get("files"), dict):
            d["files"] = {k: fix(v) for k, v in d["files"].items()}
        d.setdefault("name", os.path.splitext(os.path.basename(path))[0])
        return cls.from_dict(d, where=f"image spec {path}")

    @property
    def empty(self) -> bool:
        """Nothing to install: the host system as it is."""
        return not (self.apt or self.debs or self.pip or self.files or self.env) and self.workdir == "/work"

    def digest(self) -> str:
        """The content address (hex sha256; see the module docstring)."""
        h = hashlib.sha256()
        doc = {k: v for k, v in self.to_dict().items() if k not in ("name", "deb_dirs", "debs", "pip_find_links",
                                                                     "files")}
        doc.update(format=FORMAT, host=host_identity(), debs=[_content_hash(p) for p in self.debs],
                   pip_find_links=[_content_hash(p) for p in self.pip_find_links],
                   files={k: _content_hash(v) for k, v in sorted(self.files.items())})
        h.update(json.dumps(doc, sort_keys=True).encode())
        return h.hexdigest()


def image_path(dest: str, what: str, root_dirs: tuple[str, ...] = _ROOT_DIRS) -> str:
    """`dest` normalised; ConfigError unless it is an absolute path below one of `root_dirs`."""
    norm = posixpath.normpath(dest)
    if not dest.startswith("/") or not any(norm == "/" + r or norm.startswith("/" + r + "/") for r in root_dirs):
        raise ConfigError(f"{what}: {dest!r} must be an absolute path under " + " or ".join("/" + r for r in root_dirs)
                          + " (the image is mounted there; the rest of the system is the node's)")
    return norm


def host_identity() -> dict:
    """What a 'host' base is: Debian release, machine and python version (images built for it)."""
    try:
        with open("/etc/debian_version") as f:
            debian = f.read().strip()
    except OSError:
        debian = "unknown"
    return {"debian": debian, "machine": platform.machine(), "python": site_python()}


def site_python() -> str:
    """'3.11': the minor version of the sandbox's python3 (the host's /usr/bin/python3)."""
    try:
        out = subprocess.run([HOST_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "{}.{}".format(*sys.version_info[:2])
    except OSError:
        return "{}.{}".format(*sys.version_info[:2])


def _content_hash(path: str) -> str:
    """sha256 of a file, or of a folder's relative paths and file bytes (sorted; symlinks by target)."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    for dirpath, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            h.update(os.path.relpath(p, path).encode() + b"\0")
            h.update(os.readlink(p).encode() if os.path.islink(p) else bytes.fromhex(_content_hash(p)))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ build
def build_tree(spec: ImageSpec, root: str, work: str) -> dict:
    """Install `spec` into the empty folder `root` (the image's /), using `work` for downloads; returns the
    manifest (also written to root/.image.json). Nothing is written through a link (see `_open_image_dir`)."""
    spec.validate()
    dropped: list[str] = []
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for d in _ROOT_DIRS:  # real folders from the start: what the sandbox mounts can never become a link
            os.close(_open_image_dir(root_fd, d, "image"))
        for deb in _fetch_debs(spec, os.path.join(work, "debs")):
            dropped += _unpack_deb(deb, root_fd, os.path.join(work, "x"))
        if spec.pip:
            _pip_install(spec, root_fd, work)
        for dest, src in spec.files.items():
            rel = image_path(dest, "files").lstrip("/")
            what = f"image {spec.name!r}: files[{dest!r}]"
            parent = _open_image_dir(root_fd, posixpath.dirname(rel), what)
            try:
                _copy_in(src, parent, posixpath.basename(rel), rel, what, follow=True)
            finally:
                os.close(parent)
        check_tree(root, f"image {spec.name!r}")
        env = default_env(root)
        env.update(spec.env)
        manifest = {"format": FORMAT, "digest": spec.digest(), "name": spec.name, "spec": spec.to_dict(),
                    "env": env, "workdir": spec.workdir, "dropped": sorted(set(dropped))}
        fd = os.open(MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=root_fd)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
    finally:
        os.close(root_fd)
    _open_up(root)
    return manifest


# ------------------------------------------------------------------------ writing confined to the image
def _kind(mode: int) -> str:
    return "a symlink" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "a file"


def _lstat_at(name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _open_image_dir(root_fd: int, rel: str, what: str) -> int:
    """An fd of the real folder `rel` below `root_fd`, made where missing. Every component is opened without
    following links (O_NOFOLLOW): a link an earlier package or files: entry put in the image can never send
    a later write out of it. ImageBuildError naming `what` and the path when a component is a link or file."""
    fd = os.dup(root_fd)
    done: list[str] = []
    try:
        for name in (p for p in rel.split("/") if p not in ("", ".")):
            if name == "..":
                raise ImageBuildError(f"{what}: {rel!r} climbs out of its folder")
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            done.append(name)
            try:
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                st = _lstat_at(name, fd)
                kind = _kind(st.st_mode) if st else "missing"
                raise ImageBuildError(f"{what}: /{'/'.join(done)} is {kind} in the image (put there by an earlier "
                                      "package or files: entry), not a folder; the build never writes through "
                                      "links - drop one of the two") from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_link(target: str, rel: str, what: str) -> None:
    """Refuse a symlink at `rel` (relative to the image root, or a package's root) whose target, resolved
    inside that root, leaves it: a relative target climbing above the root with `..`. An absolute target
    (e.g. /usr/bin/python3.11) resolves inside the root the sandbox gives it and is kept; the builder never
    follows any link."""
    depth = len([p for p in posixpath.dirname(rel).split("/") if p not in ("", ".")])
    if not target or "\0" in target:
        raise ImageBuildError(f"{what}: symlink /{rel} has an empty target")
    if target.startswith("/"):
        return
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise ImageBuildError(f"{what}: symlink /{rel} -> {target} points outside the image; refused (a "
                                      "link whose target leaves the image could redirect later files to the host)")
        elif part not in ("", "."):
            depth += 1


def _merge_into(sfd: int, dfd: int, rel: str, what: str) -> None:
    """Move every entry of the folder `sfd` into the folder `dfd` (`rel`: where that is in the image): folders
    merged, files and links replacing files and links; never through a link, never a folder replaced."""
    with os.scandir(sfd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        here = posixpath.join(rel, name)
        st, dst = os.stat(name, dir_fd=sfd, follow_symlinks=False), _lstat_at(name, dfd)
        if stat.S_ISDIR(st.st_mode):
            if dst is not None and not stat.S_ISDIR(dst.st_mode):
                raise ImageBuildError(f"{what}: /{here} is {_kind(dst.st_mode)} in the image (put there by an earlier "
                                      "package or files: entry); this package has a folder there and the build "
                                      "never writes through links")
            if dst is None:
                os.mkdir(name, 0o755, dir_fd=dfd)
            s2 = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
            try:
                d2 = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    _merge_into(s2, d2, here, what)
                finally:
                    os.close(d2)
            finally:
                os.close(s2)
            continue
        if stat.S_ISLNK(st.st_mode):
            check_link(os.readlink(name, dir_fd=sfd), here, what)
        elif not stat.S_ISREG(st.st_mode):
            raise ImageBuildError(f"{what}: /{here} is not a regular file, folder or symlink (a device or FIFO)")
        if dst is not None and stat.S_ISDIR(dst.st_mode):
            raise ImageBuildError(f"{what}: /{here} is a folder in the image; this package has {_kind(st.st_mode)} "
                                  "there")
        if dst is not None:
            os.unlink(name, dir_fd=dfd)
        os.rename(name, name, src_dir_fd=sfd, dst_dir_fd=dfd)


def _copy_in(src: str, dfd: int, name: str, rel: str, what: str, follow: bool = False) -> None:
    """Copy the host file or folder `src` to `name` in the image folder `dfd` (links inside folders as links,
    checked by `check_link`), never writing through a link of the image."""
    st = os.stat(src) if follow else os.lstat(src)
    dst = _lstat_at(name, dfd)
    if stat.S_ISDIR(st.st_mode):
        if dst is not None and not stat.S_ISDIR(dst.st_mode):
            raise ImageBuildError(f"{what}: /{rel} is {_kind(dst.st_mode)} in the image, not a folder; the build "
                                  "never writes through links")
        if dst is None:
            os.mkdir(name, 0o755, dir_fd=dfd)
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            for child in sorted(os.listdir(src)):
                _copy_in(os.path.join(src, child), sub, child, posixpath.join(rel, child), what)
        finally:
            os.close(sub)
        return
    if dst is not None and stat.S_ISDIR(dst.st_mode):
        raise ImageBuildError(f"{what}: /{rel} is a folder in the image; the entry is {_kind(st.st_mode)}")
    if dst is not None:
        os.unlink(name, dir_fd=dfd)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(src)
        check_link(target, rel, what)
        os.symlink(target, name, dir_fd=dfd)
        return
    if not stat.S_ISREG(st.st_mode):
        raise ImageBuildError(f"{what}: {src} is not a regular file, folder or symlink")
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    with os.fdopen(out, "wb") as w, open(src, "rb") as r:
        shutil.copyfileobj(r, w, 1 << 20)
        os.fchmod(w.fileno(), stat.S_IMODE(st.st_mode) & 0o777)


def check_tree(root: str, what: str) -> None:
    """An image tree is confined: what the sandbox mounts (/usr/local, /opt) are real folders, not links the
    host would follow when binding them, and no link anywhere climbs out of the image (`check_link`)."""
    for d in _ROOT_DIRS:
        p = os.path.join(root, d)
        if os.path.lexists(p) and not stat.S_ISDIR(os.lstat(p).st_mode):
            raise ImageBuildError(f"{what}: /{d} is {_kind(os.lstat(p).st_mode)}, not a folder; the sandbox would "
                                  "mount what it points to on the host")
    check_links(root, what)


def check_links(root: str, what: str) -> None:
    """Every symlink below `root` (walked without following links) passes `check_link`."""
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                check_link(os.readlink(p), os.path.relpath(p, root), what)


def default_env(root: str) -> dict[str, str]:
    """LD_LIBRARY_PATH for the image's shared libraries (the host's ld.so.cache does not list them)."""
    libs = [d for d in (f"/usr/local/lib/{platform.machine()}-linux-gnu", "/usr/local/lib")
            if glob.glob(os.path.join(root, d.lstrip("/"), "*.so*"))]
    return {"LD_LIBRARY_PATH": ":".join(libs)} if libs else {}


_INST = re.compile(r"^Inst (\S+) (\[[^\]]*\] )?\((\S+) ")


def apt_options(spec: ImageSpec, work: str) -> list[str]:
    """apt-get options for `spec`: [] (the host's sources), or a private apt state over `apt_sources`, updated
    here (no root: no lock, lists and caches under `work`)."""
    if not spec.apt_sources:
        return []
    state = os.path.join(work, "apt")
    os.makedirs(os.path.join(state, "lists", "partial"), exist_ok=True)
    with open(os.path.join(state, "sources.list"), "w") as f:
        f.write("\n".join(spec.apt_sources) + "\n")
    opts = ["-o", f"Dir::Etc::SourceList={state}/sources.list", "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={state}/lists", "-o", f"Dir::Cache={state}", "-o", "Dir::Cache::pkgcache=",
            "-o", "Dir::Cache::srcpkgcache=", "-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=" + _me()]
    try:
        r = subprocess.run(["apt-get", *opts, "-q", "update"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageBuildError(f"apt_sources {spec.apt_sources}: apt-get update could not run ({e})") from None
    if r.returncode != 0 or "Failed to fetch" in r.stderr:
        raise ImageBuildError(f"apt_sources {spec.apt_sources}: apt-get update failed: "
                              f"{(r.stderr or r.stdout).strip()[-300:]}; check the source lines")
    return opts


def _me() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return "root"


def resolve_apt(spec: ImageSpec, opts: list[str]) -> list[str]:
    """The apt packages of the image: each listed one (`name` or `name=version`), then each dependency that
    the base does not have installed, as `name=version` (apt's resolver: `apt-get install -s`; upgrades of
    packages the base has are left to the base). Local .debs (`debs`, and listed packages found in `deb_dirs`)
    are taken as they are, and their own dependencies are resolved the same way (apt reads the files)."""
    asked = [p for p in spec.apt if not _local_deb(spec.deb_dirs, *p.partition("=")[::2])]
    local = [os.path.abspath(d) for d in spec.debs] + [os.path.abspath(f) for f in (
        _local_deb(spec.deb_dirs, *p.partition("=")[::2]) for p in spec.apt) if f]
    if not (spec.apt_deps and (asked or local)):
        return list(spec.apt)
    what = "apt package " + " / ".join(map(repr, asked + [os.path.basename(d) for d in local]))
    try:
        r = subprocess.run(["apt-get", *opts, "install", "-s", "-q", "--no-install-recommends", *asked, *local],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "LANG": "C"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageBuildError(f"{what}: apt's resolver could not run ({e}); put the .debs in a deb_dirs folder or "
                              "list them under debs") from None
    if r.returncode != 0:
        raise ImageBuildError(f"{what}: apt's resolver failed: {r.stderr.strip()[-300:]}; check the names, "
                              "`apt-get update`, or the spec's apt_sources")
    names = {p.partition("=")[0] for p in spec.apt} | {_deb_name(d) for d in local}
    deps = [f"{m[1]}={m[3]}" for m in map(_INST.match, r.stdout.splitlines())
            if m and not m[2] and m[1] not in names]
    return list(spec.apt) + deps


def _deb_name(deb: str) -> str:
    """The package name a local .deb declares (its control file's `Package`)."""
    r = subprocess.run(["dpkg-deb", "-f", deb, "Package"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise ImageBuildError(f"{deb}: not a readable .deb: {r.stderr.strip()[-300:]}")
    return r.stdout.strip()


def _fetch_debs(spec: ImageSpec, dest: str) -> list[str]:
    out = list(spec.debs)
    opts = apt_options(spec, os.path.dirname(dest))
    for pkg in resolve_apt(spec, opts):
        name, _, version = pkg.partition("=")
        found = _local_deb(spec.deb_dirs, name, version)
        if found:
            out.append(found)
            continue
        os.makedirs(dest, exist_ok=True)
        try:
            r = subprocess.run(["apt-get", *opts, "download", pkg], cwd=dest, capture_output=True, text=True,
                               timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ImageBuildError(f"apt package {pkg!r}: apt-get download failed ({e}); put its .deb in a deb_dirs "
                                  "folder or list it under debs") from None
        got = _local_deb([dest], name, version)
        if r.returncode != 0 or not got:
            raise ImageBuildError(f"apt package {pkg!r}: apt-get download failed: {r.stderr.strip()[-300:]}; check "
                                  "the name and `apt-get update`, or put its .deb in a deb_dirs folder")
        out.append(got)
    return out


def _local_deb(dirs: list[str], name: str, version: str) -> str | None:
    for d in dirs:
        ver = version.replace(":", "%3a") if version else "*"
        hits = sorted(glob.glob(os.path.join(glob.escape(d), f"{glob.escape(name)}_{ver}_*.deb")))
        if hits:
            return hits[-1]
    return None


_MOVES = (("usr/lib/python3/dist-packages", "usr/local/{py}"), ("usr/local", "usr/local"), ("usr", "usr/local"),
          ("bin", "usr/local/bin"), ("sbin", "usr/local/sbin"), ("lib", "usr/local/lib"),
          ("lib64", "usr/local/lib64"), ("opt", "opt"))
"""Where a package's folders go in the image (package path -> image path), first match first."""


def _unpack_deb(deb: str, root_fd: int, scratch: str) -> list[str]:
    """dpkg-deb -x into `scratch`, then move its files into the image's /usr/local (see the module docstring);
    returns the top-level entries dropped (etc, var, links at the top ...). ImageBuildError naming the package
    for a link that leaves the package or the image, or a write that would go through a link."""
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    r = subprocess.run(["dpkg-deb", "-x", deb, scratch], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise ImageBuildError(f"{deb}: dpkg-deb -x failed: {r.stderr.strip()[-300:]}")
    what = f"package {os.path.basename(deb)}"
    check_links(scratch, what)  # links climbing out of the package itself
    py = f"lib/python{site_python()}/dist-packages"
    for src, dst in _MOVES:
        sfd = _open_package_dir(scratch, src)
        if sfd is None:  # missing, or a link / file in the package: moved by a shorter entry, or dropped
            continue
        try:
            dfd = _open_image_dir(root_fd, dst.format(py=py), what)
            try:
                _merge_into(sfd, dfd, dst.format(py=py), what)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
        shutil.rmtree(os.path.join(scratch, src))  # only (empty) real folders are left of it
    dropped = [f"{os.path.basename(deb)}:{n}" for n in os.listdir(scratch)]
    shutil.rmtree(scratch, ignore_errors=True)
    return dropped


def _open_package_dir(scratch: str, rel: str) -> int | None:
    """An fd of the real folder `rel` of an unpacked package, None when missing or when a component is not a
    real folder (a link of the package is never followed)."""
    fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    for name in (p for p in rel.split("/") if p not in ("", ".")):
        try:
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = nfd
    return fd


def _pip_install(spec: ImageSpec, root_fd: int, work: str) -> None:
    """pip install --target a fresh folder of `work` (pip never sees the image, nor a link a package put in
    it), then merged into /usr/local's site folder and its console scripts into /usr/local/bin (`_merge_into`)."""
    target = os.path.join(work, "pip")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    cmd = [HOST_PYTHON if _has_pip(HOST_PYTHON) else sys.executable, "-m", "pip", "install", "--target", target,
           "--no-compile", "--disable-pip-version-check", "--no-warn-script-location", "--quiet"]
    for d in spec.pip_find_links:
        cmd += ["--find-links", d]
    if spec.pip_no_index:
        cmd.append("--no-index")
    r = subprocess.run(cmd + list(spec.pip), capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1"})
    if r.returncode != 0:
        raise ImageBuildError(f"pip install {' '.join(spec.pip)} failed: {(r.stderr or r.stdout).strip()[-400:]}")
    what = f"pip install {' '.join(spec.pip)}"
    for src, dst in (("bin", "usr/local/bin"), (".", f"usr/local/lib/python{site_python()}/dist-packages")):
        sfd = _open_package_dir(target, src)
        if sfd is None:
            continue
        try:
            dfd = _open_image_dir(root_fd, dst, what)
            try:
                _merge_into(sfd, dfd, dst, what)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
        if src != ".":
            shutil.rmtree(os.path.join(target, src))


def _has_pip(python: str) -> bool:
    try:
        return subprocess.run([python, "-m", "pip", "--version"], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def _open_up(root: str) -> None:
    """Everything readable (and folders traversable) by the sandbox's uids; nothing writable but by the owner."""
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                mode = os.lstat(p).st_mode
                os.chmod(p, 0o755 if mode & 0o111 else 0o644)


# ------------------------------------------------------------------------------------------------ pack
def has_squashfs() -> bool:
    return bool(shutil.which("mksquashfs") and shutil.which("unsquashfs"))


def pack(root: str, out: str, fmt: str) -> None:
    """`root` as one file `out` ('sqfs': mksquashfs; 'tar': an uncompressed tar, owners numeric 0)."""
    if fmt == "sqfs":
        r = subprocess.run(["mksquashfs", root, out, "-noappend", "-all-root", "-quiet", "-no-progress"],
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise ImageBuildError(f"mksquashfs failed: {r.stderr.strip()[-300:]}")
        return
    def reset(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        return ti

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for name in sorted(os.listdir(root)):
            tf.add(os.path.join(root, name), arcname=name, filter=reset)


def unpack(path: str, dest: str) -> None:
    """Extract an image file into the (new) folder `dest`."""
    if path.endswith(".sqfs"):
        r = subprocess.run(["unsquashfs", "-no-xattrs", "-quiet", "-no-progress", "-d", dest, path],
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise ImageBuildError(f"unsquashfs {path} failed: {r.stderr.strip()[-300:]}")
        return
    os.makedirs(dest)
    with tarfile.open(path) as tf:
        tf.extractall(dest, members=_safe_members(tf, path))


def _safe_members(tf: tarfile.TarFile, path: str):
    """The tar's members, refusing names outside the destination, device files, hard links out and any member
    below a symlink of the archive (nothing is written through a link); symlinks themselves may point
    anywhere (they are resolved inside the sandbox, as packages' absolute links must be)."""
    links: set[str] = set()
    for m in tf:
        name = posixpath.normpath(m.name)
        parts = name.split("/")
        bad = (name.startswith(("/", "..")) or m.isdev() or (m.islnk() and posixpath.normpath(m.linkname)
               .startswith(("/", ".."))) or any("/".join(parts[:i]) in links for i in range(1, len(parts))))
        if bad:
            raise ImageBuildError(f"{path}: member {m.name!r} would be extracted outside the image; not an image "
                                  "built here")
        if m.issym():
            links.add(name)
        yield m


def store_file(store: str, digest: str) -> str | None:
    """The image file of `digest` in `store`, when built."""
    for ext in ("sqfs", "tar"):
        p = os.path.join(store, f"{digest}.{ext}")
        if os.path.isfile(p):
            return p
    return None


def build(spec: ImageSpec, store: str, fmt: str | None = None) -> str:
    """The image file of `spec` in `store` (the shared filesystem), built when missing: in a private folder of
    the store, then published with an atomic rename (concurrent builders of one digest: the last rename wins,
    with the same content). Returns its path."""
    digest = spec.digest()
    found = store_file(store, digest)
    if found:
        return found
    fmt = fmt or ("sqfs" if has_squashfs() else "tar")
    os.makedirs(store, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".build-{digest[:16]}-", dir=store)
    try:
        root = os.path.join(tmp, "root")
        os.mkdir(root)
        build_tree(spec, root, os.path.join(tmp, "work"))
        out = os.path.join(tmp, f"{digest}.{fmt}")
        pack(root, out, fmt)
        os.chmod(out, 0o644)
        with open(out, "rb") as f:
            os.fsync(f.fileno())
        final = os.path.join(store, f"{digest}.{fmt}")
        os.replace(out, final)
        fd = os.open(store, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
