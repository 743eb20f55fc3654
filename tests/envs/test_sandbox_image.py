"""Per-domain sandbox images (envs.sandbox.image, image_cache, domain_images): a package only in the image is
usable inside its sandboxes and absent outside; content addresses; the node cache; the product paths (the
mixture's envs.domains.<d>.image, Harbor's environment/ -> image, SandboxConfig) and the Apptainer command."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

from envs.sandbox import SandboxConfig, domain_images, image_cache
from envs.sandbox.apptainer import ApptainerSandbox
from envs.sandbox.bwrap import BwrapSandbox
from envs.sandbox.image import ImageBuildError, ImageSpec, build, has_squashfs
from megatron_rl.config import ConfigError

HELLO = "mrl-image-hello"
needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb (Debian) is needed to build .debs")


@pytest.fixture()
def open_dir():
    """A fresh folder the sandbox uids can traverse (pytest's tmp_path is 0700: bwrap as a slot uid fails)."""
    d = tempfile.mkdtemp(prefix="mrl-test-image-")
    os.chmod(d, 0o755)
    yield Path(d)
    domain_images.close_all()
    shutil.rmtree(d, ignore_errors=True)


def make_deb(folder: Path, version: str = "1.0") -> Path:
    """A tiny .deb: a program on PATH and a python module (usr/lib/python3/dist-packages)."""
    pkg = folder / f"pkg-{version}"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr/bin").mkdir(parents=True)
    (pkg / "usr/lib/python3/dist-packages").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(f"Package: {HELLO}\nVersion: {version}\nArchitecture: all\n"
                                        "Maintainer: t <t@example.org>\nDescription: test\n")
    (pkg / "usr/bin" / HELLO).write_text(f"#!/bin/sh\necho hello-from-deb-{version}\n")
    os.chmod(pkg / "usr/bin" / HELLO, 0o755)
    (pkg / "usr/lib/python3/dist-packages/mrl_debmod.py").write_text("X = 7\n")
    debs = folder / "debs"
    debs.mkdir(exist_ok=True)
    out = debs / f"{HELLO}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(out)], check=True,
                   capture_output=True)
    return out


def make_wheel(folder: Path, value: int = 42) -> Path:
    wheels = folder / "wheels"
    wheels.mkdir(exist_ok=True)
    path = wheels / "mrl_wheelmod-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mrl_wheelmod/__init__.py", f"VALUE = {value}\n")
        z.writestr("mrl_wheelmod-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: mrl-wheelmod\nVersion: 1.0\n")
        z.writestr("mrl_wheelmod-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("mrl_wheelmod-1.0.dist-info/RECORD", "")
    return wheels


PROBE = (f"{HELLO}; python3 -I -c 'import mrl_wheelmod, mrl_debmod; print(mrl_wheelmod.VALUE, mrl_debmod.X)'; "
         "echo $IMAGE_GREETING; cat /opt/data/motd")


@pytest.mark.slow
@needs_dpkg
def test_package_only_in_the_image_is_usable_inside_its_sandbox_and_absent_outside(open_dir):
    """A spec YAML (apt package from a local .deb folder, a pip wheel offline, a file, env) through SandboxConfig:
    built into ONE file in the store, extracted into the node cache, mounted read-only."""
    make_deb(open_dir)
    make_wheel(open_dir)
    (open_dir / "motd").write_text("file-in-image\n")
    spec = {"apt": [HELLO], "deb_dirs": ["debs"], "pip": ["mrl-wheelmod"], "pip_find_links": ["wheels"],
            "pip_no_index": True, "files": {"/opt/data/motd": "motd"}, "env": {"IMAGE_GREETING": "hi"}}
    (open_dir / "img.yaml").write_text(yaml.safe_dump(spec))
    cfg = SandboxConfig(layer=str(open_dir / "img.yaml"), image_store=str(open_dir / "store"),
                        image_cache=str(open_dir / "cache"), prespawn=False)
    with cfg.build() as sb:
        r = sb.run(PROBE)
        assert r.ok, r
        assert r.stdout == "hello-from-deb-1.0\n42 7\nhi\nfile-in-image\n"
        w = sb.run(f"echo x > /usr/local/bin/{HELLO}")  # read-only: a run cannot change the image for later runs
        assert w.exit_code != 0 and "Read-only" in w.stderr
    stored = os.listdir(open_dir / "store")
    assert len(stored) == 1 and stored[0].endswith(".sqfs" if has_squashfs() else ".tar")
    with BwrapSandbox(prespawn=False) as bare:
        r = bare.run(PROBE)
        assert r.exit_code != 0 and "not found" in r.stderr and "No module named 'mrl_wheelmod'" in r.stderr
    assert shutil.which(HELLO) is None


def control_deb(folder: Path, name: str, depends: str, script: str) -> None:
    """A .deb `name` (a program of the same name running `script`) that depends on `depends`."""
    pkg = folder / name
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr/bin").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(f"Package: {name}\nVersion: 2.0\nArchitecture: all\nDepends: {depends}\n"
                                        "Maintainer: t <t@example.org>\nDescription: test\n")
    (pkg / "usr/bin" / name).write_text(f"#!/bin/sh\n{script}\n")
    os.chmod(pkg / "usr/bin" / name, 0o755)
    out = folder / "repo" / f"{name}_2.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(out)], check=True, capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dpkg-scanpackages") is None or shutil.which("apt-get") is None,
                    reason="dpkg-dev and apt are needed to make and read a local apt repository")
def test_apt_dependencies_the_base_lacks_are_resolved_into_the_image(open_dir):
    """The spec lists one package; apt's resolver adds its dependency that the base lacks (from the spec's own
    apt source, a local repository), and leaves out the one the base has (bash)."""
    from envs.sandbox.image import apt_options, resolve_apt

    (open_dir / "repo").mkdir()
    control_deb(open_dir, "mrl-dep-app", "mrl-dep-lib (>= 2.0), bash", "mrl-dep-lib; echo app-ok")
    control_deb(open_dir, "mrl-dep-lib", "bash", "echo lib-ok")
    (open_dir / "repo/Packages").write_bytes(subprocess.run(["dpkg-scanpackages", "-m", "."], cwd=open_dir / "repo",
                                                            check=True, capture_output=True).stdout)
    spec = ImageSpec(apt=["mrl-dep-app"], deb_dirs=[], apt_sources=[f"deb [trusted=yes] file:{open_dir}/repo ./"])
    assert resolve_apt(spec, apt_options(spec, str(open_dir / "w"))) == ["mrl-dep-app", "mrl-dep-lib=2.0"]
    assert resolve_apt(dataclasses.replace(spec, apt_deps=False), []) == ["mrl-dep-app"]
    with BwrapSandbox(layer=image_cache.resolve(spec, str(open_dir / "store"), str(open_dir / "cache")),
                      prespawn=False) as sb:
        r = sb.run("mrl-dep-app; ls /usr/local/bin")
    assert r.stdout == "lib-ok\napp-ok\nmrl-dep-app\nmrl-dep-lib\n", r  # the dependency is in; bash is not
    with pytest.raises(ImageBuildError, match="mrl-no-such"):
        resolve_apt(dataclasses.replace(spec, apt=["mrl-no-such"]), apt_options(spec, str(open_dir / "w2")))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dpkg-scanpackages") is None or shutil.which("apt-get") is None,
                    reason="dpkg-dev and apt are needed to make and read a local apt repository")
def test_dependencies_of_a_local_deb_are_resolved_into_the_image(open_dir):
    """A local .deb (`debs`) depends on a package the base lacks: apt's resolver finds it in the spec's apt
    source and the image holds both; a dependency found nowhere refuses the build, naming the .deb."""
    from envs.sandbox.image import apt_options, resolve_apt

    (open_dir / "repo").mkdir()
    control_deb(open_dir, "mrl-dep-lib", "bash", "echo lib-ok")
    (open_dir / "repo/Packages").write_bytes(subprocess.run(["dpkg-scanpackages", "-m", "."], cwd=open_dir / "repo",
                                                            check=True, capture_output=True).stdout)
    (open_dir / "local/repo").mkdir(parents=True)
    control_deb(open_dir / "local", "mrl-dep-app", "mrl-dep-lib (>= 2.0), bash", "mrl-dep-lib; echo app-ok")
    control_deb(open_dir / "local", "mrl-dep-orphan", "mrl-dep-nowhere", "echo orphan")
    app, orphan = (str(open_dir / "local/repo" / f"{n}_2.0_all.deb") for n in ("mrl-dep-app", "mrl-dep-orphan"))
    source = [f"deb [trusted=yes] file:{open_dir}/repo ./"]
    spec = ImageSpec(debs=[app], deb_dirs=[], apt_sources=source)
    assert resolve_apt(spec, apt_options(spec, str(open_dir / "w"))) == ["mrl-dep-lib=2.0"]
    assert resolve_apt(dataclasses.replace(spec, apt_deps=False), []) == []
    with BwrapSandbox(layer=image_cache.resolve(spec, str(open_dir / "store"), str(open_dir / "cache")),
                      prespawn=False) as sb:
        r = sb.run("mrl-dep-app")
    assert r.stdout == "lib-ok\napp-ok\n", r
    with pytest.raises(ImageBuildError, match="mrl-dep-orphan"):
        resolve_apt(dataclasses.replace(spec, debs=[orphan]), apt_options(spec, str(open_dir / "w2")))


def test_same_spec_same_digest_changed_spec_or_input_new_digest(open_dir):
    (open_dir / "a.txt").write_text("one")
    spec = ImageSpec(name="x", pip=["mrl-wheelmod"], files={"/opt/a.txt": str(open_dir / "a.txt")}, env={"K": "1"})
    same = ImageSpec(name="renamed", pip=["mrl-wheelmod"], files={"/opt/a.txt": str(open_dir / "a.txt")},
                     env={"K": "1"})
    d0 = spec.digest()
    assert same.digest() == d0 and len(d0) == 64  # the label is not content
    changed = [ImageSpec(name="x", pip=["mrl-wheelmod==2"], files=spec.files, env=spec.env),
               ImageSpec(name="x", pip=spec.pip, files=spec.files, env={"K": "2"}),
               ImageSpec(name="x", pip=spec.pip, apt=["jq"], files=spec.files, env=spec.env)]
    assert len({c.digest() for c in changed} | {d0}) == 4
    (open_dir / "a.txt").write_text("two")  # an input's bytes are part of the address
    assert spec.digest() != d0


def test_build_publishes_once_and_reuses_the_stored_file(open_dir):
    (open_dir / "tool").write_text("#!/bin/sh\necho tool-v1\n")
    os.chmod(open_dir / "tool", 0o755)
    spec = ImageSpec(files={"/usr/local/bin/mrl-tool": str(open_dir / "tool")})
    f1 = build(spec, str(open_dir / "store"), fmt="tar")
    ino = os.stat(f1).st_ino
    assert build(spec, str(open_dir / "store"), fmt="tar") == f1 and os.stat(f1).st_ino == ino  # not rebuilt
    assert sorted(os.listdir(open_dir / "store")) == [os.path.basename(f1)]  # no build leftovers
    layer = image_cache.ensure_cached(f1, str(open_dir / "cache"))
    assert layer.fill_s > 0 and image_cache.ensure_cached(f1, str(open_dir / "cache")).fill_s == 0.0
    with BwrapSandbox(layer=layer, prespawn=False) as sb:
        assert sb.run("mrl-tool").stdout == "tool-v1\n"


def test_bad_specs_are_refused_naming_the_key(open_dir):
    (open_dir / "bad.yaml").write_text("apt: [jq]\npackages: [x]\n")
    with pytest.raises(ConfigError, match="packages"):
        ImageSpec.load(str(open_dir / "bad.yaml"))
    with pytest.raises(ConfigError, match="/etc/x.*under /usr/local or /opt"):
        ImageSpec(files={"/etc/x": str(open_dir)}).validate()
    with pytest.raises(ConfigError, match="subprocess backend mounts nothing"):
        SandboxConfig(backend="subprocess", layer="x.yaml").validate()


def test_missing_apt_package_fails_the_build_naming_it(open_dir, monkeypatch):
    monkeypatch.setenv("PATH", str(open_dir))  # no apt-get: the download cannot happen
    with pytest.raises(Exception, match="apt package 'mrl-no-such-pkg'"):
        build(ImageSpec(apt=["mrl-no-such-pkg"], deb_dirs=[str(open_dir)]), str(open_dir / "store"), fmt="tar")
    assert [n for n in os.listdir(open_dir / "store")] == []  # nothing half-built is published


def test_apptainer_runs_the_image_as_an_overlay_and_auto_selects_apptainer_on_path(open_dir, monkeypatch):
    (open_dir / "tool").write_text("x")
    spec = ImageSpec(files={"/usr/local/share/t": str(open_dir / "tool")}, env={"A": "b"}, workdir="/opt")
    for fmt in ("sqfs", "tar") if has_squashfs() else ("tar",):
        layer = image_cache.ensure_cached(build(spec, str(open_dir / f"store-{fmt}"), fmt=fmt), str(open_dir / "c"))
        argv = ApptainerSandbox("base.sif", require_binary=False, layer=layer).command_line(["true"], "/s")
        assert "--env" in argv and "A=b" in argv and argv[argv.index("--pwd") + 1] == "/opt"
        if fmt == "sqfs":
            assert argv[argv.index("--overlay") + 1] == f"{layer.file}:ro"
        else:
            assert f"{layer.root}/usr/local:/usr/local:ro" in argv and "--overlay" not in argv
    fake = open_dir / "bin"
    fake.mkdir()
    (fake / "apptainer").write_text("#!/bin/sh\nexit 0\n")
    os.chmod(fake / "apptainer", 0o755)
    assert SandboxConfig(backend="auto", image="base.sif").resolved_backend() in ("bwrap", "apptainer")
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    cfg = SandboxConfig(backend="auto", image="base.sif", layer=layer.file, image_cache=str(open_dir / "c"))
    sb = cfg.build()
    assert isinstance(sb, ApptainerSandbox) and sb.layer.digest == layer.digest
    assert SandboxConfig(backend="auto").resolved_backend() == "bwrap"  # no base image: bubblewrap


@pytest.mark.slow
@needs_dpkg
def test_mixture_domain_names_its_image_and_its_environment_runs_in_it(open_dir):
    """The run config's envs.domains.<d>.image: validated, and build_env's sandbox is the image's."""
    from envs.mixture import DomainConfig, MixtureConfig

    make_deb(open_dir)
    (open_dir / "code.yaml").write_text(yaml.safe_dump({"apt": [HELLO], "deb_dirs": ["debs"]}))
    mix = MixtureConfig(domains={"code": DomainConfig(image=str(open_dir / "code.yaml"))},
                        image_store=str(open_dir / "store"), image_cache=str(open_dir / "cache"))
    mix.validate()
    env = mix.build_env("code", 512)
    assert env.sandbox.run(HELLO).stdout == "hello-from-deb-1.0\n"
    assert mix.build_env("code", 512).sandbox is env.sandbox  # one sandbox per image per process
    with pytest.raises(ConfigError, match="does not exist"):
        MixtureConfig(domains={"code": DomainConfig(image=str(open_dir / "nope.yaml"))}).validate()
    with pytest.raises(ConfigError, match="harbor only"):
        MixtureConfig(domains={"code": DomainConfig(image="dockerfile")}).validate()


@pytest.mark.slow
@needs_dpkg
def test_harbor_dockerfile_packages_the_host_lacks_build_the_tasks_image(open_dir, monkeypatch):
    """A Harbor task whose Dockerfile installs a package this host lacks: refused by the host check, and with
    envs.domains.harbor.image=dockerfile built into its image; the agent's command and the verifier both
    run in it (reward 1.0 only where the package works)."""
    from envs.harbor import image as harbor_image
    from envs.harbor.host import MissingPackage
    from envs.harbor.loader import load_task_folder
    from envs.mixture import DomainConfig, MixtureConfig

    make_deb(open_dir)
    monkeypatch.setattr(harbor_image, "DEB_DIRS", [str(open_dir / "debs")])
    task = open_dir / "tasks" / "needs-hello"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Run the hello tool.\n")
    (task / "task.toml").write_text('version = "1.0"\n[metadata]\nsplit = "train"\n')
    (task / "environment" / "Dockerfile").write_text(
        f"FROM debian:bookworm\nRUN apt-get update && apt-get install -y {HELLO} jq\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/bash\nif {HELLO} | grep -q hello-from-deb; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")
    with pytest.raises(MissingPackage, match=HELLO):
        load_task_folder(task)
    mix = MixtureConfig(domains={"harbor": DomainConfig(task_files=[str(open_dir / "tasks")], image="dockerfile")},
                        image_store=str(open_dir / "store"), image_cache=str(open_dir / "cache"))
    mix.validate()  # builds the image before any episode
    assert len(os.listdir(open_dir / "store")) == 1
    (t,) = mix.tasks("train")["harbor"]
    assert t.payload["image"]["apt"] == [HELLO]  # jq is on the host: not in the image
    env = mix.build_env("harbor", 4096)
    env.reset(t)
    r = env.step(f'<tool_call>{{"name": "shell", "arguments": {{"command": "{HELLO}"}}}}</tool_call>')
    assert "hello-from-deb-1.0" in r.observation.text
    end = env.step("Done.")
    assert end.done and end.reward == 1.0


def test_a_tar_that_would_write_outside_the_cache_is_refused(open_dir):
    import io
    import tarfile

    outside = open_dir / "outside"
    outside.mkdir()
    for members in (["../escape"], ["/abs"], ["link->" + str(outside), "link/evil"]):
        bad = open_dir / "store" / ("0" * 64 + ".tar")
        bad.parent.mkdir(exist_ok=True)
        with tarfile.open(bad, "w") as tf:
            for m in members:
                if "->" in m:
                    ti = tarfile.TarInfo(m.split("->")[0])
                    ti.type, ti.linkname = tarfile.SYMTYPE, m.split("->")[1]
                    tf.addfile(ti)
                else:
                    ti = tarfile.TarInfo(m)
                    ti.size = 1
                    tf.addfile(ti, io.BytesIO(b"x"))
        with pytest.raises(Exception, match="outside the image"):
            image_cache.ensure_cached(str(bad), str(open_dir / "cache"))
        assert os.listdir(outside) == [] and not (open_dir / "escape").exists()
        assert os.listdir(open_dir / "cache") == ["0" * 64 + ".lock"]  # nothing published, no temp left


# -------------------------------------------------------------------- builds confined to the image's folder
def payload_deb(folder: Path, name: str, entries: dict) -> Path:
    """A .deb named `name` whose payload holds `entries`: path -> text (a file) or ("link", target)."""
    pkg = folder / f"src-{name}"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
                                        "Maintainer: t <t@example.org>\nDescription: test\n")
    for path, v in entries.items():
        p = pkg / path
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(v, tuple):
            os.symlink(v[1], p)
        else:
            p.write_text(v)
    out = folder / f"{name}_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(out)], check=True,
                   capture_output=True)
    return out


def _spec(name: str, debs: list[Path], **kw) -> ImageSpec:
    return ImageSpec(name=name, debs=[str(d) for d in debs], apt_deps=False, deb_dirs=[], **kw)


@needs_dpkg
def test_attack_package_links_never_redirect_later_packages_or_files_entries(open_dir):
    """A link a package puts in the image (absolute, `..`, a chain of links) must not send a later package's
    files or a `files:` entry out of the image: the build refuses, naming the package or entry, and the host
    folder the link points at stays empty (the builder used to follow such links: root on a root worker)."""
    host = open_dir / "host"
    host.mkdir()
    src = open_dir / "payload.txt"
    src.write_text("pwned")
    up = "../" * 12 + str(host).lstrip("/")
    cases = {  # name: (packages as (name, entries), files, what the error names)
        "absolute": ([("mrl-abs", {"usr/lib/evil": ("link", str(host))}),
                      ("mrl-writer", {"usr/lib/evil/pwned": "x"})], {}, "mrl-writer_1.0_all.deb"),
        "dotdot": ([("mrl-up", {"usr/lib/up": ("link", up)}), ("mrl-writer2", {"usr/lib/up/pwned": "x"})], {},
                   "mrl-up_1.0_all.deb"),
        "chain": ([("mrl-chain", {"usr/lib/a": ("link", "b"), "usr/lib/b": ("link", str(host))}),
                   ("mrl-writer3", {"usr/lib/a/pwned": "x"})], {}, "mrl-writer3_1.0_all.deb"),
        "files": ([("mrl-opt", {"opt/evil": ("link", str(host))})], {"/opt/evil/pwned": str(src)},
                  "files['/opt/evil/pwned']"),
        "files-dir": ([("mrl-opt2", {"opt/d/evil": ("link", str(host))})], {"/opt/d": str(open_dir / "tree")},
                      "files['/opt/d']"),
    }
    (open_dir / "tree" / "evil").mkdir(parents=True)
    (open_dir / "tree" / "evil" / "pwned").write_text("x")
    for case, (pkgs, files, named) in cases.items():
        debs = [payload_deb(open_dir / case, n, e) for n, e in pkgs]
        with pytest.raises(ImageBuildError) as e:
            build(_spec(case, debs, files=files), str(open_dir / "store"))
        assert named in str(e.value), (case, str(e.value))
        assert os.listdir(host) == [], case
    assert [n for n in os.listdir(open_dir / "store") if not n.startswith(".")] == []


@needs_dpkg
def test_attack_a_package_cannot_turn_the_mounted_folders_into_links(open_dir):
    """A package whose /usr or /opt is a link to the host (bwrap would bind the host folder as the image's
    /usr/local or /opt; later packages would be written there) is dropped at the top; the image's folders stay
    real and the next package lands inside the image."""
    host = open_dir / "host"
    host.mkdir()
    debs = [payload_deb(open_dir, "mrl-top", {"usr": ("link", str(host)), "opt": ("link", str(host))}),
            payload_deb(open_dir, "mrl-after", {"usr/bin/mrl-after": "#!/bin/sh\necho after\n", "opt/x": "x"})]
    layer = image_cache.resolve(_spec("top", debs), str(open_dir / "store"), str(open_dir / "cache"))
    assert os.listdir(host) == []
    assert [src for src, _ in layer.mounts()] == [os.path.join(layer.root, "usr/local"),
                                                  os.path.join(layer.root, "opt")]
    assert (Path(layer.root) / "usr/local/bin/mrl-after").is_file() and (Path(layer.root) / "opt/x").is_file()
    with open(Path(layer.root) / ".image.json") as f:
        assert {"mrl-top_1.0_all.deb:usr", "mrl-top_1.0_all.deb:opt"} <= set(yaml.safe_load(f)["dropped"])


@needs_dpkg
def test_links_that_stay_in_the_image_are_kept(open_dir):
    """Ordinary package links: absolute (resolved in the sandbox's root, never by the builder) and relative
    ones inside the image are kept as they are, and a program reaches its file through them."""
    debs = [payload_deb(open_dir, "mrl-links", {"usr/lib/mrl/tool.sh": "echo via-link\n",
                                                "usr/bin/mrl-rel": ("link", "../lib/mrl/tool.sh"),
                                                "usr/bin/mrl-py": ("link", "/usr/bin/python3")})]
    layer = image_cache.resolve(_spec("links", debs), str(open_dir / "store"), str(open_dir / "cache"))
    assert os.readlink(Path(layer.root) / "usr/local/bin/mrl-rel") == "../lib/mrl/tool.sh"
    assert os.readlink(Path(layer.root) / "usr/local/bin/mrl-py") == "/usr/bin/python3"
    with BwrapSandbox(layer=layer, prespawn=False) as s:
        r = s.run("sh /usr/local/bin/mrl-rel && mrl-py -c 'print(7)'")
    assert r.ok and r.stdout == "via-link\n7\n", r


def test_a_stored_image_whose_mounted_folder_is_a_link_is_refused(open_dir):
    import io
    import tarfile

    bad = open_dir / "store" / ("1" * 64 + ".tar")
    bad.parent.mkdir()
    with tarfile.open(bad, "w") as tf:
        ti = tarfile.TarInfo(".image.json")
        ti.size = 2
        tf.addfile(ti, io.BytesIO(b"{}"))
        for name, target in (("usr", None), ("usr/local", "/"), ("opt", "../../../..")):
            ti = tarfile.TarInfo(name)
            if target is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            else:
                ti.type, ti.linkname = tarfile.SYMTYPE, target
            tf.addfile(ti)
    with pytest.raises(ImageBuildError, match="/usr/local is a symlink, not a folder"):
        image_cache.ensure_cached(str(bad), str(open_dir / "cache"))
    assert os.listdir(open_dir / "cache") == ["1" * 64 + ".lock"]


@pytest.mark.slow
@needs_dpkg
def test_attack_pip_scripts_never_follow_a_package_link(open_dir):
    """A package whose /usr/bin is a link to a host folder: pip's console scripts (merged into /usr/local/bin
    after pip ran) used to land in that host folder. The build refuses, naming pip, and the folder stays empty."""
    host = open_dir / "host"
    host.mkdir()
    wheels = open_dir / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "mrl_scriptmod-1.0-py3-none-any.whl", "w") as z:
        z.writestr("mrl_scriptmod/__init__.py", "def main():\n    print('hi')\n")
        z.writestr("mrl_scriptmod-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: mrl-scriptmod\nVersion: 1.0\n")
        z.writestr("mrl_scriptmod-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("mrl_scriptmod-1.0.dist-info/entry_points.txt",
                   "[console_scripts]\nmrl-script = mrl_scriptmod:main\n")
        z.writestr("mrl_scriptmod-1.0.dist-info/RECORD", "")
    debs = [payload_deb(open_dir, "mrl-binlink", {"usr/bin": ("link", str(host))})]
    spec = _spec("pipscripts", debs, pip=["mrl-scriptmod"], pip_find_links=[str(wheels)], pip_no_index=True)
    with pytest.raises(ImageBuildError, match="pip install mrl-scriptmod: /usr/local/bin is a symlink"):
        build(spec, str(open_dir / "store"))
    assert os.listdir(host) == []
