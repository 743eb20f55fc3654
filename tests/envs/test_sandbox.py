"""Sandbox backends. The attack suite runs against real bubblewrap (installed on the dev machines): each attack
must be contained, reported as a violation by name, and leave the sandbox serving normal programs."""
from __future__ import annotations

import ast
import contextlib
import errno
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest

from megatron_rl.envs.sandbox import SANDBOXES, Limits, Sandbox, SandboxConfig, SandboxUnavailable, build_sandbox
from megatron_rl.envs.sandbox._linux import pids_of_uid
from megatron_rl.envs.sandbox.apptainer import ApptainerSandbox
from megatron_rl.envs.sandbox.bwrap import BwrapSandbox
from megatron_rl.envs.sandbox.pool import SandboxPool
from megatron_rl.envs.sandbox.subprocess_backend import SubprocessSandbox

ROOT = os.geteuid() == 0
"""Root gets per-slot uids, cgroups and a scratch tmpfs; a normal user gets the fallbacks (tested too, as uid
65534, by scripts/test.sh)."""
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (mounts, per-slot uids or cgroups); "
                                "the normal-user fallbacks are tested separately")


def _cgroups(s: BwrapSandbox, controller: str = "memory") -> bool:
    return s._s.cells[0].cg is not None and s._s.cells[0].cg.has(controller)


TIGHT = Limits(wall_s=10, cpu_s=2, memory_mb=96, pids=32, file_size_mb=2, scratch_mb=8, output_bytes=64 << 10)


@pytest.fixture(scope="module")
def sb():
    with BwrapSandbox() as s:
        yield s


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(lambda i: BwrapSandbox(), workers=2)
    yield p
    p.close()
    assert not [pid for s in p.slots for pid in s.processes()], "processes of a closed pool remain"


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ basics
def test_runs_a_program_with_files_in_and_out(sb):
    r = sb.run_python(
        "import os, sys\n"
        "data = open('in/data.bin', 'rb').read()\n"
        "open('out.txt', 'w').write(open('msg.txt').read().upper() + str(len(data)))\n"
        "print(os.getcwd(), os.getuid(), sys.stdin.read().strip())\n",
        files={"msg.txt": "hello", "in/data.bin": b"\x00\x01\x02"},
        stdin=b"from-stdin\n", collect=["out.txt", "missing.txt", "main.py"])
    assert r.ok, r
    assert r.stdout.split() == ["/work", "1000", "from-stdin"]
    assert r.files == {"out.txt": b"HELLO3", "main.py": r.files["main.py"]}
    assert r.wall_s > 0 and (r.cpu_s > 0 or not _cgroups(sb, "cpuacct"))  # CPU time comes from cpuacct


def test_exit_codes_and_shell_strings(sb):
    assert sb.run("exit 3").exit_code == 3
    r = sb.run(["sh", "-c", "kill -TERM $$"])
    assert r.exit_code == -15 and r.violations == []
    r = sb.run(["no-such-program-xyz"])
    assert r.exit_code == 127 and "not found" in r.stderr


def test_prespawned_sandboxes_serve_runs_and_get_each_runs_limits(sb):
    show = "import resource as r\nprint(*[r.getrlimit(x) for x in (r.RLIMIT_CPU, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE)])"
    before = dict(sb.counts)
    for _ in range(3):
        assert sb.run_python(show).stdout == "(10, 11) (16777216, 16777216) (256, 256)\n"
    assert sb.counts["prespawned"] - before["prespawned"] >= 2
    other = Limits(cpu_s=3, file_size_mb=1, open_files=64)
    assert sb.run_python(show, limits=other).stdout == "(3, 4) (1048576, 1048576) (64, 64)\n"
    assert sb.run_python(show, limits=other).stdout == "(3, 4) (1048576, 1048576) (64, 64)\n"
    assert sb.run_python(show).stdout == "(10, 11) (16777216, 16777216) (256, 256)\n"


@pytest.mark.slow
def test_discarded_prespawns_leave_nothing_behind():
    """Alternating limits make every run discard the sandbox prespawned for the previous limits (often while
    bwrap is still setting it up): its processes must still be killed and reaped, and close() must find
    empty cgroups to remove."""
    s = BwrapSandbox()
    groups = [d for c in s._s.cells if c.cg for d in c.cg.dirs.values()]
    for i in range(40):
        assert s.run(["true"], limits=Limits(cpu_s=1 + i % 2)).ok
    assert s.counts["cold"] >= 40
    assert s.leftover_processes() == []
    s.close()
    assert [g for g in groups if os.path.exists(g)] == []


def test_non_utf8_output_is_replaced_not_fatal(sb):
    r = sb.run_python("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\xc3')\nsys.stderr.buffer.write(b'\\x80')")
    assert r.ok and r.stdout.startswith("ok ") and "\ufffd" in r.stdout and r.stderr == "\ufffd"


def test_caller_errors_raise(sb):
    for bad in ("/etc/passwd", "../x", "a/../../x", ""):
        with pytest.raises(ValueError, match="relative path"):
            sb.run(["true"], files={bad: "x"})
    with pytest.raises(ValueError, match="command"):
        sb.run([])
    assert sb.run(["true"]).ok  # still serving


def test_setup_failure_files_larger_than_scratch(sb):
    r = sb.run(["true"], files={"big": b"x" * (3 << 20)}, limits=Limits(scratch_mb=1))
    assert r.violations == ["setup"] and "sandbox setup failed" in r.stderr
    assert sb.run(["true"]).ok


@pytest.fixture()
def open_dir():
    """A fresh directory the sandbox uids can traverse (pytest's tmp_path is 0700 root: bwrap would fail)."""
    d = tempfile.mkdtemp(prefix="mrl-test-rootfs-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_setup_failure_in_bwrap_is_reported_as_setup(open_dir):
    """A rootfs directory (here: the host's /usr bound into a fresh root) works; when bwrap cannot mount part
    of it (it vanished after construction) the run reports 'setup' (not the program's exit 1), and the next
    run works again once it is back."""
    root = open_dir
    (root / "usr").mkdir(parents=True)
    (root / "opt").mkdir()
    for name in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), root / name)
    subprocess.run(["mount", "--bind", "-o", "ro", "/usr", str(root / "usr")], check=True)
    try:
        with BwrapSandbox(rootfs=str(root), prespawn=False) as s:
            ok = s.run("echo in-rootfs; exit 1")
            assert ok.exit_code == 1 and ok.stdout == "in-rootfs\n" and ok.violations == []
            (root / "opt").rmdir()  # bwrap's bind of /opt fails
            bad = s.run("exit 1")
            assert bad.violations == ["setup"] and "opt" in bad.stderr, bad
            (root / "opt").mkdir()
            assert s.run("true").ok
    finally:
        subprocess.run(["umount", "-l", str(root / "usr")], check=True)


def test_unusable_rootfs_fails_at_construction_with_the_fix(open_dir, tmp_path):
    with pytest.raises(SandboxUnavailable, match="cannot start a sandbox.*execvp true"):
        BwrapSandbox(rootfs=str(open_dir))  # empty: nothing to run
    with pytest.raises(SandboxUnavailable, match="readable by the sandbox uids"):
        BwrapSandbox(rootfs=str(tmp_path))  # 0700 root-owned parents
    with pytest.raises(ValueError, match="not a directory"):
        BwrapSandbox(rootfs=str(tmp_path / "missing"))


# ------------------------------------------------------------------------------------- attack suite
def test_attack_network_connect_to_host_port_is_refused(sb):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted = []

    def accept_loop(stop):
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                pass

    stop = threading.Event()
    t = threading.Thread(target=accept_loop, args=(stop,))
    t.start()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0mrl-test-" + uuid.uuid4().hex.encode())
    abstract.listen(1)
    try:
        r = sb.run_python(
            "import socket\n"
            f"for host in ('127.0.0.1', '10.0.0.1', '8.8.8.8'):\n"
            "    try:\n"
            f"        socket.create_connection((host, {port}), timeout=1); print('CONNECTED', host)\n"
            "    except OSError as e: print('blocked', host, type(e).__name__)\n"
            "u = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    u.connect({abstract.getsockname()!r}); print('CONNECTED unix')\n"
            "except OSError as e: print('blocked unix', type(e).__name__)\n",
            limits=TIGHT)
    finally:
        stop.set()
        t.join()
        listener.close()
        abstract.close()
    assert "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 4, r
    assert accepted == []


def test_network_flag_shares_the_host_network_for_trusted_domains(sb):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        r = sb.run(["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"],
                   limits=Limits(network=True))
        listener.settimeout(5)
        conn, _ = listener.accept()
        conn.close()
    finally:
        listener.close()
    assert r.ok, r


def test_attack_reading_host_files_fails(sb, tmp_path, monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("MRL_SECRET_TOKEN", token)  # the worker's environment does not leak in either
    secrets = [f"/tmp/mrl-secret-{token}", str(tmp_path / "secret")] + ([f"/root/mrl-secret-{token}"] if ROOT else [])
    for p in secrets:
        with open(p, "w") as f:
            f.write(token)
    try:
        r = sb.run(
            ["python3", "-c",
             "import sys, os\n"
             "found = []\n"
             "for p in sys.argv[1:] + ['/etc/shadow', '/work/main/CONTRIBUTING.md', '/proc/1/root/etc/shadow']:\n"
             "    try:\n"
             "        found.append(p + ':' + open(p).read()[:40])\n"
             "    except OSError:\n"
             "        pass\n"
             "os.symlink(sys.argv[1], 'leak')\n"
             "print(found, [v for v in os.environ.values() if v == sys.argv[1][-32:]])\n", *secrets],
            limits=TIGHT, collect=["leak"])
        assert r.ok, r
        assert r.stdout.strip() == "[] []" and r.stdout.count(token) == 0
        assert r.files == {}  # the symlink to a host secret is not followed when collecting
    finally:
        for p in secrets:
            os.unlink(p)


def test_attack_writes_outside_scratch_do_not_reach_host(sb):
    token = uuid.uuid4().hex
    targets = [f"/mrl-{token}", f"/usr/mrl-{token}", f"/etc/mrl-{token}", f"/tmp/mrl-{token}",
               f"/dev/shm/mrl-{token}", f"/var/tmp/mrl-{token}", f"/root/mrl-{token}"]
    r = sb.run(["python3", "-c",
                "import sys\n"
                "for p in sys.argv[1:]:\n"
                "    try:\n"
                "        open(p, 'w').write('x'); print('wrote', p)\n"
                "    except OSError as e:\n"
                "        print('denied', p, e.errno)\n", *targets], limits=TIGHT)
    assert r.ok, r
    # only the sandbox's own /tmp (scratch) and /dev (private tmpfs) may accept the write
    assert {line.split()[1] for line in r.stdout.splitlines() if line.startswith("wrote")} <= {
        f"/tmp/mrl-{token}", f"/dev/shm/mrl-{token}"}
    for p in targets:
        assert not os.path.exists(p), f"sandbox write reached the host: {p}"


@pytest.mark.slow
def test_attack_fork_bomb_is_capped_and_reported(sb):
    r = sb.run("f() { f | f & }; f; sleep 1", limits=TIGHT)
    assert "pids" in r.violations, r
    r = sb.run_python("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        if os.fork() == 0:\n"
                      "            time.sleep(1)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
                      "        time.sleep(0.005)\nprint(n)\n", limits=TIGHT)
    assert int(r.stdout) < TIGHT.pids, r
    if _cgroups(sb, "pids"):  # the kernel counts refused forks; without the cgroup only a message can tell
        assert "pids" in r.violations, r
    assert sb.leftover_processes() == []
    assert sb.run(["true"]).ok


def test_attack_memory_bomb_is_oom_killed(sb):
    r = sb.run_python("x = []\nwhile True:\n    x.append(bytearray(1 << 20))\n", limits=TIGHT)
    if not _cgroups(sb):  # a normal user: RLIMIT_AS per process, the program sees MemoryError
        assert "memory" in r.violations and "MemoryError" in r.stderr, r
        return  # memory of many processes together is not bounded without the cgroup (threat model)
    assert "memory" in r.violations and r.exit_code == -9, r
    assert 80 <= r.peak_memory_mb <= TIGHT.memory_mb + 1
    # memory in many processes is bounded as a whole (cgroup), not per process
    r = sb.run_python("import os\nfor _ in range(8):\n    if os.fork() == 0:\n        break\n"
                      "x = bytearray(30 << 20)\nimport time; time.sleep(1)\n", limits=TIGHT)
    assert "memory" in r.violations, r


@pytest.mark.slow
def test_attack_cpu_loop_is_stopped(sb):
    r = sb.run_python("while True:\n    pass\n", limits=Limits(cpu_s=1, wall_s=60))  # CPU decides, not load
    assert "cpu" in r.violations and r.exit_code < 0, r
    if not _cgroups(sb, "cpuacct"):
        return  # a normal user: RLIMIT_CPU per process only, no CPU total of the tree (threat model)
    assert 0.8 <= r.cpu_s < 3
    # CPU spread over processes (each under RLIMIT_CPU) is caught by the cgroup's total
    r = sb.run_python("import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n",
                      limits=Limits(cpu_s=0.5, wall_s=60, cpus=2))
    assert "cpu" in r.violations and r.cpu_s >= 0.5, r


@pytest.mark.slow
def test_attack_sleep_hits_wall_timeout(sb):
    t0 = time.monotonic()
    r = sb.run(["sleep", "60"], limits=Limits(wall_s=1))
    assert r.violations == ["wall"] and r.exit_code == -9 and time.monotonic() - t0 < 10


def test_attack_output_flood_is_capped(sb):
    r = sb.run(["yes", "spam"], limits=TIGHT)
    assert "output" in r.violations and len(r.stdout.encode()) == TIGHT.output_bytes, r.violations
    r = sb.run_python("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n", limits=TIGHT)
    assert "output" in r.violations and len(r.stderr) == TIGHT.output_bytes


def test_attack_disk_fill_is_capped(sb):
    r = sb.run(["dd", "if=/dev/zero", "of=big", "bs=1M", "count=50"], limits=TIGHT)
    assert "file_size" in r.violations and r.exit_code == -25, r
    r = sb.run_python("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 19))\n", limits=TIGHT)
    assert "file_size" in r.violations and ("No space left" in r.stderr or not sb._s.cells[0].tmpfs), r
    r = sb.run_python("for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 19))\n",
                      limits=TIGHT)
    assert "file_size" in r.violations, r
    assert sb.run('[ -z "$(ls -A /work)" ] && [ -z "$(ls -A /tmp)" ]').ok  # the next run starts with empty scratch


def test_attack_setsid_daemon_does_not_survive():
    with BwrapSandbox(prespawn=False) as s:
        (uid,) = s.uids
        r = s.run("setsid sh -c 'sleep 120' >/dev/null 2>&1 < /dev/null & "
                  "python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                  "    if os.fork() == 0:\n        time.sleep(120)\n' & sleep 0.3; echo started", limits=TIGHT)
        assert r.stdout == "started\n" and r.ok, r
        assert s.processes() == [] and (not ROOT or pids_of_uid(uid) == [])


@pytest.mark.slow
def test_attack_kill_all_cannot_reach_a_concurrent_sandbox(pool):
    victim = pool.submit("sleep 1.5; echo alive", limits=TIGHT)
    end = time.monotonic() + 20
    while not any(s.leftover_processes() for s in pool.slots) and time.monotonic() < end:
        time.sleep(0.02)  # until the victim runs: the attack must hit it while it is alive
    assert not victim.done()
    attacker = pool.submit("kill -9 -1; for p in $(seq 1 500); do [ $p -ne $$ ] && kill -9 $p 2>/dev/null; done; "
                           "echo done",
                           limits=TIGHT).result()
    v = victim.result()
    assert attacker.stdout == "done\n", attacker
    assert v.ok and v.stdout == "alive\n", v


@pytest.mark.slow
def test_pool_keeps_serving_after_attacks(pool):
    attacks = [
        dict(command=["python3", "-c", "while True: pass"], limits=Limits(cpu_s=1, wall_s=10)),
        dict(command=["python3", "-c", "x = bytearray(1 << 30)"], limits=TIGHT),
        dict(command=["yes"], limits=TIGHT),
        dict(command="f() { f | f & }; f; sleep 1", limits=TIGHT),
        dict(command=["sleep", "30"], limits=Limits(wall_s=0.5)),
    ]
    futs = [pool.submit(**a) for a in attacks]
    got = [f.result().violations for f in futs]
    # a CPU loop ends as "cpu", or as "wall" when other load keeps it from its CPU second within wall_s
    assert [bool({"cpu", "wall"} & set(got[0])), "memory" in got[1], "output" in got[2], "pids" in got[3],
            "wall" in got[4]] == [True] * 5, got
    results = pool.map([_square_job(i) for i in range(6)])
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)] and all(r.ok for r in results)


def _square_job(i: int):
    from megatron_rl.envs.sandbox import SandboxJob

    return SandboxJob(command=["python3", "main.py", str(i)],
                      files={"main.py": "import sys\nn = int(sys.argv[1])\nassert n >= 0\nprint(n * n)\n"})


@pytest.mark.slow
def test_no_zombies_over_many_fast_runs(sb):
    for _ in range(100):
        r = sb.run(["true"])
        assert r.ok, r
    assert sb.leftover_processes() == []
    zombies = [pid for pid in sb.processes() if _proc_state(pid) == "Z"]
    assert zombies == []
    used = [c for c in sb._s.cells if c is not sb._s.next.result().cell]
    if _cgroups(sb, "pids"):
        assert [c.cg.tasks_alive_or_zombie() for c in used] == [0]  # the kernel's count, zombies included


# ------------------------------------------------------------------------------------ other backends
@pytest.mark.slow
def test_subprocess_backend_warns_and_enforces_limits(tmp_path):
    with pytest.warns(RuntimeWarning, match="isolates NOTHING"):
        s = SubprocessSandbox()
    r = s.run_python("import os\nprint(open('a.txt').read(), os.getcwd() != '/')", files={"a.txt": "hi"},
                     collect=["a.txt"])
    assert r.ok and r.stdout == "hi True\n" and r.files == {"a.txt": b"hi"}
    assert "wall" in s.run(["sleep", "30"], limits=Limits(wall_s=0.5)).violations
    assert "output" in s.run(["yes"], limits=Limits(output_bytes=1000)).violations
    assert "cpu" in s.run(["python3", "-c", "while True: pass"], limits=Limits(cpu_s=1, wall_s=60)).violations
    assert "file_size" in s.run(["dd", "if=/dev/zero", "of=x", "bs=1M", "count=5"],
                                limits=Limits(file_size_mb=1)).violations
    assert "memory" in s.run(["python3", "-c", "x = bytearray(1 << 30)"], limits=Limits(memory_mb=128)).violations
    assert "THIS BACKEND ISOLATES NOTHING" in inspect.getmodule(SubprocessSandbox).__doc__


def test_apptainer_command_line_and_missing_binary(tmp_path):
    with pytest.raises(SandboxUnavailable, match="Apptainer not found.*module load apptainer"):
        ApptainerSandbox("img.sif", binary=str(tmp_path / "apptainer"))
    a = ApptainerSandbox("/images/py.sif", require_binary=False, limits=Limits(memory_mb=256))
    argv = a.command_line(["python3", "main.py"], "/scratch/run1")
    assert argv[:5] == ["apptainer", "exec", "--containall", "--no-home", "--cleanenv"]
    joined = " ".join(argv)
    assert "--net --network none --bind /scratch/run1:/work --pwd /work" in joined
    assert argv[-3:] == ["/images/py.sif", "python3", "main.py"]
    assert "--memory" not in argv
    shell = ApptainerSandbox("x.sif", require_binary=False, cgroup_flags=True).command_line(
        "echo hi", "/s", Limits(memory_mb=300, pids=10, cpus=2, network=True))
    assert "--network" not in shell and shell[-4:] == ["x.sif", "/bin/sh", "-c", "echo hi"]
    i = shell.index("--memory")
    assert shell[i:i + 6] == ["--memory", "300M", "--memory-swap", "300M", "--pids-limit", "10"]
    assert shell[shell.index("--cpus") + 1] == "2"
    with pytest.raises(SandboxUnavailable, match="Apptainer not found"):
        ApptainerSandbox("x.sif", require_binary=False).run(["true"])


def test_registry_contract():
    assert {"bwrap", "apptainer", "subprocess"} <= set(SANDBOXES.names())
    expected = list(inspect.signature(Sandbox.run).parameters)
    for name, cls in SANDBOXES.items():
        assert issubclass(cls, Sandbox), name
        assert list(inspect.signature(cls.run).parameters) == expected, name
        assert cls.name == name
        doc = inspect.getmodule(cls).__doc__
        assert "THREAT MODEL" in doc and "Not covered" in doc, f"{name}: module must open with its threat model"
    assert list(inspect.signature(SandboxPool.run).parameters) == expected


def test_build_sandbox_from_config():
    with build_sandbox(SandboxConfig(limits=Limits(wall_s=5))) as s:
        assert isinstance(s, BwrapSandbox) and s.default_limits.wall_s == 5
        assert s.run(["true"]).ok
    with build_sandbox(SandboxConfig(workers=2, prespawn=False)) as p:
        assert isinstance(p, SandboxPool) and p.workers == 2
        assert [r.ok for r in p.map([_square_job(1), _square_job(2)])] == [True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(build_sandbox(SandboxConfig(backend="subprocess")), SubprocessSandbox)
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="image"):
        build_sandbox(SandboxConfig(backend="apptainer"))
    with pytest.raises(ConfigError, match="workers"):
        build_sandbox(SandboxConfig(workers=0))
    with pytest.raises(KeyError, match="unknown sandbox backend 'nsjail'"):
        build_sandbox(SandboxConfig(backend="nsjail"))


def test_close_removes_cgroups_mounts_scratch_and_processes():
    s = BwrapSandbox()
    assert s.run("sleep 0.1 & echo x > /tmp/y").ok
    groups = [d for c in s._s.cells if c.cg for d in c.cg.dirs.values()]
    base, uids = s._s.base, s.uids
    assert all(os.path.isdir(g) for g in groups) and (f"{base}/cell0/fs" in open("/proc/mounts").read() or not ROOT)
    s.close()
    s.close()  # idempotent
    assert not [g for g in groups if os.path.exists(g)]
    assert f"{base}/" not in open("/proc/mounts").read() and not os.path.exists(base)
    assert s.processes() == [] and (not ROOT or [pid for u in uids for pid in pids_of_uid(u)] == [])
    with pytest.raises(RuntimeError, match="closed"):
        s.run(["true"])


def test_a_forked_child_exiting_does_not_tear_down_the_parents_sandbox(sb):
    pid = os.fork()
    if pid == 0:  # what the finalizers of a forked child's normal exit would do
        try:
            sb._s.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert sb.run(["true"]).ok and sb.run(["true"]).ok


def test_leftovers_of_a_crashed_worker_are_removed_by_the_next_one(repo_root):
    crash = ("import os, sys, glob\nfrom megatron_rl.envs.sandbox.bwrap import BwrapSandbox\ns = BwrapSandbox()\n"
             "print(s._s.base, *[d for c in s._s.cells if c.cg for d in c.cg.dirs.values()])\nsys.stdout.flush()\n"
             "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", crash], cwd=repo_root, capture_output=True, text=True, check=True)
    base, *groups = out.stdout.split()
    mounts = open("/proc/mounts").read()
    assert os.path.isdir(base) and (f"{base}/cell0/fs" in mounts or not ROOT) and all(os.path.isdir(g) for g in groups)
    subprocess.run([sys.executable, "-c",
                    "from megatron_rl.envs.sandbox.bwrap import BwrapSandbox\nBwrapSandbox().close()"],
                   cwd=repo_root, check=True)
    assert not os.path.exists(base) and f"{base}/" not in open("/proc/mounts").read()
    assert not [g for g in groups if os.path.exists(g)]


# ------------------------------------------------------------------------------------- slot cleanup
@pytest.mark.slow
def test_attack_deep_tree_and_planted_modules_do_not_poison_the_slot():
    """1500 nested directories (deeper than Python's recursion limit) in every writable place, plus a planted
    json.py: the next runs in the same slots start empty and import the real json."""
    deep = ("import os\n"
            "for top in ('/work', '/tmp', '/dev/shm'):\n"
            "    fd = os.open(top, os.O_RDONLY)\n"
            "    for _ in range(1500):\n"
            "        os.mkdir('d', dir_fd=fd)\n"
            "        fd, old = os.open('d', os.O_RDONLY, dir_fd=fd), fd\n"
            "        os.close(old)\n"
            "for p in ('/work/json.py', '/tmp/json.py'):\n"
            "    open(p, 'w').write('print(\"POISONED\")')\n"
            "print('made')\n")
    with BwrapSandbox() as s:
        for _ in range(2):  # both prespawn slots get the tree
            r = s.run_python(deep, limits=Limits(wall_s=60, pids=16))
            assert r.stdout == "made\n", r
        for _ in range(2):
            r = s.run('ls -A /work /tmp /dev/shm; python3 -c "import json; print(json.__file__)"')
            assert r.ok and r.stdout.split()[:3] == ["/dev/shm:", "/tmp:", "/work:"], r
            assert r.stdout.split()[3].startswith("/usr/lib/python3"), r
        assert s.counts["retired"] == 0


def test_dev_shm_is_inside_the_capped_scratch(sb):
    r = sb.run("for i in $(seq 20); do head -c 1000000 /dev/zero > /dev/shm/f$i || exit 1; done", limits=TIGHT)
    assert "file_size" in r.violations and ("No space left" in r.stderr or not sb._s.cells[0].tmpfs), r
    assert sb.run('[ -z "$(ls -A /dev/shm)" ]').ok


@pytest.mark.slow
@needs_root
def test_a_slot_that_cannot_be_emptied_is_retired_and_replaced():
    """A mount inside scratch (here made by the test as root, standing in for any cause) makes the slot
    impossible to empty: it is retired - its directory and uid never used again - and a new slot serves."""
    with BwrapSandbox(prespawn=False) as s:
        (old,) = s._s.cells
        old_dir, old_uid = old.dir, old.uid
        stop = threading.Event()

        def mount_when_ready():
            while not stop.is_set() and not os.path.isdir(os.path.join(old.work, "sub")):
                time.sleep(0.01)
            if not stop.is_set():
                subprocess.run(["mount", "-t", "tmpfs", "none", os.path.join(old.work, "sub")], check=True)

        t = threading.Thread(target=mount_when_ready)
        t.start()
        try:
            r = s.run("mkdir sub; sleep 1; echo x > sub/f", limits=TIGHT)
        finally:
            stop.set()
            t.join()
        assert r.ok, r
        assert s.counts["retired"] == 1
        (new,) = s._s.cells
        assert new.dir != old_dir and new.uid != old_uid and not os.path.exists(old_dir)
        assert f"{old_dir}/" not in open("/proc/mounts").read()
        r = s.run('ls -A /work; id -u')
        assert r.ok and r.stdout == "1000\n" and s.uids == [new.uid], r


@needs_root
def test_stale_sweep_never_follows_symlinks(tmp_path):
    """Stale folders of dead workers are swept, but a planted symlink (as the folder, its cell, or its fs) is
    never followed: the mount it points to stays mounted."""
    from megatron_rl.envs.sandbox import bwrap as bw

    victim = tmp_path / "victim"
    victim.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(victim)], check=True)
    (victim / "keep").write_text("x")
    dead = subprocess.Popen(["true"])
    dead.wait()
    base = Path(tempfile.gettempdir())
    planted = [base / f"{bw._PREFIX}{dead.pid}{tail}" for tail in ("-fs", "-cell", "")]
    try:
        (planted[0] / "cell0").mkdir(parents=True)
        os.symlink(victim, planted[0] / "cell0" / "fs")
        planted[1].mkdir()
        (tmp_path / "c").mkdir()
        os.symlink(tmp_path / "c", planted[1] / "cell0")
        os.symlink(victim, tmp_path / "c" / "fs")
        os.symlink(victim, planted[2])
        bw._stale_done = False
        bw._remove_stale_once()
        assert str(victim) in open("/proc/mounts").read() and (victim / "keep").read_text() == "x"
        assert not planted[0].exists() and not planted[1].exists()
        assert (tmp_path / "c" / "fs").is_symlink()  # the link's target directory was not entered
    finally:
        for p in planted:
            if p.is_symlink():
                p.unlink()
            elif p.exists():
                shutil.rmtree(p)
        subprocess.run(["umount", "-l", str(victim)], check=False)


@needs_root
def test_stale_slot_cgroups_are_swept_by_several_processes_at_once():
    """Every rank of a job sweeps the slot cgroups of dead workers when it builds its sandbox, all at once. A
    group another sweeper removed between the listing and the entering is its goal reached, never an error
    (CI once lost a 4-rank world to FileNotFoundError there). Deterministic half: the group vanishes exactly in
    that gap. Racing half: four processes sweep the same twenty stale groups."""
    from megatron_rl.envs.sandbox import _cgroup

    own = {c: d for c, d in _cgroup.own_v1_groups().items() if os.access(d, os.W_OK)}
    if "memory" not in own:
        pytest.skip("no writable cgroup v1 memory hierarchy on this host")
    dead = subprocess.Popen(["true"])
    dead.wait()
    prefix = f"mrl-test-stale-{os.getpid()}-"

    def plant(n):
        for d in own.values():
            for i in range(n):
                os.makedirs(os.path.join(d, f"{prefix}{dead.pid}-{i}", "slot0"))

    def left():
        return [n for d in own.values() for n in os.listdir(d) if n.startswith(prefix)]

    try:
        plant(1)

        def alive_but_a_peer_sweeps_first(pid):  # called between the parent's listing and the group's
            for d in own.values():
                g = os.path.join(d, f"{prefix}{dead.pid}-0")
                for gone in (os.path.join(g, "slot0"), g):
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(gone)
            return False

        _cgroup.remove_stale_groups(prefix, alive_but_a_peer_sweeps_first)
        assert left() == []

        plant(20)
        code = ("import sys; from megatron_rl.envs.sandbox import _cgroup; "
                "_cgroup.remove_stale_groups(sys.argv[1], lambda pid: False)")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        procs = [subprocess.Popen([sys.executable, "-c", code, prefix], stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(4)]
        errs = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
        assert all(rc == 0 for rc, _ in errs), errs
        assert left() == []
    finally:
        for d in own.values():
            for n in os.listdir(d):
                if n.startswith(prefix):
                    for sub in os.listdir(os.path.join(d, n)):
                        if os.path.isdir(os.path.join(d, n, sub)):
                            os.rmdir(os.path.join(d, n, sub))
                    os.rmdir(os.path.join(d, n))


# ------------------------------------------------------------------------------------------ seccomp
_SYSCALLS = """
import ctypes, os, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
x86 = platform.machine() == "x86_64"
calls = {  # name: (number, args)
    "keyctl": (250 if x86 else 219, (0, -3, 1)),  # KEYCTL_GET_KEYRING_ID of the session keyring, create
    "add_key": (248 if x86 else 217, (ctypes.c_char_p(b"user"), ctypes.c_char_p(b"k"), ctypes.c_char_p(b"v"), 1,
                                      -3)),
    "request_key": (249 if x86 else 218, (ctypes.c_char_p(b"user"), ctypes.c_char_p(b"k"), None, -3)),
    "ptrace": (101 if x86 else 117, (0, 0, 0, 0)),  # PTRACE_TRACEME
    "unshare": (272 if x86 else 97, (0x00020000,)),  # CLONE_NEWNS
    "mount": (165 if x86 else 40, (ctypes.c_char_p(b"none"), ctypes.c_char_p(b"/tmp"), ctypes.c_char_p(b"tmpfs"),
                                   0, None)),
    "bpf": (321 if x86 else 280, (0, None, 0)),
    "perf_event_open": (298 if x86 else 241, (None, 0, -1, -1, 0)),
    "userfaultfd": (323 if x86 else 282, (0,)),
    "io_uring_setup": (425, (1, ctypes.create_string_buffer(120))),
}
for name, (nr, args) in calls.items():
    rc = libc.syscall(nr, *args)
    print(name, rc, ctypes.get_errno() if rc == -1 else 0)
"""


def test_attack_blocked_syscalls_fail_with_eperm(sb):
    """Keyrings, ptrace, namespaces, mounts, bpf, perf, userfaultfd and io_uring are refused (EPERM) by the
    seccomp filter; without it the keyring calls and ptrace succeed."""
    r = sb.run_python(_SYSCALLS, limits=TIGHT)
    assert r.ok, r
    got = {line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in r.stdout.splitlines()}
    assert len(got) == 10 and all(v == (-1, 1) for v in got.values()), got  # errno 1 = EPERM


def test_seccomp_leaves_ordinary_programs_working(sb):
    r = sb.run("python3 -c 'import threading, subprocess, multiprocessing as m; t = threading.Thread(target=print); "
               "t.start(); t.join(); print(subprocess.run([\"sh\", \"-c\", \"echo sub\"], capture_output=True).stdout)'"
               " && sh -c 'echo $((6 * 7))' && ls / >/dev/null && echo ok", limits=Limits(pids=64))
    assert r.ok and r.stdout.split("\n")[-2] == "ok" and "42" in r.stdout and "b'sub\\n'" in r.stdout, r
    if shutil.which("gcc"):
        r = sb.run("printf 'int main(void){return 7;}' > a.c && gcc a.c -o a && ./a", limits=Limits(wall_s=30))
        assert r.exit_code == 7, r


def test_seccomp_program_is_well_formed():
    from megatron_rl.envs.sandbox import _seccomp

    for machine in ("x86_64", "aarch64"):
        prog = _seccomp.program(machine)
        assert len(prog) % 8 == 0 and len(prog) // 8 < 256
    with pytest.raises(ValueError, match="no seccomp filter for architecture"):
        _seccomp.program("riscv64")


def test_remove_tree_any_depth_no_links_no_leaks(tmp_path):
    from megatron_rl.envs.sandbox._linux import remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    root = tmp_path / "tree"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    for i in range(3000):  # deeper than any recursion limit and than PATH_MAX allows as one path
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
        if i % 700 == 0:
            os.symlink(outside, "link", dir_fd=fd)
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    os.close(fd)
    os.chmod(root / "d" / "d", 0)
    fds = len(os.listdir("/proc/self/fd"))
    assert remove_tree(str(root)) == [] and not root.exists()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert (outside / "keep").read_text() == "x" and remove_tree(str(root)) == []


# ------------------------------------------------------------------------------------- normal users
_AS_NOBODY = """
import json, sys
from megatron_rl.envs.sandbox.base import Limits
from megatron_rl.envs.sandbox.bwrap import BwrapSandbox
out = {}
with BwrapSandbox() as s:
    r = s.run_python("import os, time\\nn = 0\\nfor _ in range(200):\\n    try:\\n        if os.fork() == 0:\\n"
                     "            time.sleep(2)\\n            os._exit(0)\\n        n += 1\\n    except OSError:\\n"
                     "        break\\nprint(n)\\n", limits=Limits(pids=16, wall_s=20))
    out["forks"], out["notes"] = int(r.stdout), r.notes
    out["bomb"] = s.run("f() { f | f & }; f; sleep 1", limits=Limits(pids=16, wall_s=10)).violations
    r = s.run_python("import threading\\nts = [threading.Thread(target=print) for _ in range(8)]\\n"
                     "[t.start() for t in ts]\\n[t.join() for t in ts]\\n", limits=Limits(pids=16))
    out["threads_ok"] = r.ok
    out["keyctl"] = s.run(["python3", "-c", "import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                           "print(l.syscall(250, 0, -3, 1), ctypes.get_errno())"]).stdout.split()
    out["uid"] = s.run(["id", "-u"]).stdout.strip()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_normal_user_worker_caps_processes_per_run(repo_root):
    """As uid 65534 (no root, no writable cgroups) a run's process count is still capped - RLIMIT_NPROC set in the
    run's own user namespace counts only its processes - and seccomp holds; the notes say what is degraded."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo_root), "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    who = dict(user=65534, group=65534, extra_groups=[]) if os.geteuid() == 0 else {}  # else: already a normal user
    r = subprocess.run(["/usr/bin/python3", "-c", _AS_NOBODY], env=env, cwd="/", capture_output=True, text=True,
                       timeout=120, **who)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["forks"] <= 16 and "pids" in out["bomb"] and out["threads_ok"], out
    assert out["keyctl"] == ["-1", "1"] and out["uid"] == "1000"
    assert any("RLIMIT_NPROC" in n for n in out["notes"]) and any("cgroup" in n for n in out["notes"])


_SCRATCH_AS_NOBODY = """
import json, os
from megatron_rl.envs.sandbox.base import Limits
from megatron_rl.envs.sandbox.bwrap import BwrapSandbox
prog = ("import os\\nout = {}\\nfor d in ('/work', '/tmp', '/dev/shm'):\\n    n = 0\\n    try:\\n"
        "        with open(d + '/fill', 'wb') as f:\\n            for _ in range(50):\\n"
        "                f.write(b'x' * (1 << 20))\\n                f.flush()\\n                n += 1\\n"
        "    except OSError as e:\\n        out[d] = [n, e.errno]\\n        os.unlink(d + '/fill')\\n"
        "        continue\\n"
        "    out[d] = [n, 0]\\nprint(out)\\n")
with BwrapSandbox(prespawn=False) as s:
    real = getattr(s._s.cells[0], "real_fs", s._s.cells[0].fs)  # the folder bwrap binds, as the host sees it
    r = s.run_python(prog, files={"in.txt": "x"}, limits=Limits(scratch_mb=8, file_size_mb=64, wall_s=20),
                     collect=["in.txt"])
    host = sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(real) for f in fs)
    print(json.dumps({"stdout": r.stdout, "violations": r.violations, "notes": r.notes, "host_bytes": host,
                      "collected": r.files.get("in.txt", b"").decode(), "next": s.run(["ls", "-A"]).stdout}))
"""


def test_normal_user_scratch_is_capped_while_the_run_writes(repo_root):
    """As uid 65534, a run writing 50 MiB into /work, /tmp and /dev/shm with scratch_mb=8 is stopped by ENOSPC
    at the cap while it runs (a tmpfs in the worker's own user namespace), nothing lands in the host's folder, the
    input file still reaches the run and is collected, and the next run starts empty."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo_root), "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    who = dict(user=65534, group=65534, extra_groups=[]) if os.geteuid() == 0 else {}
    r = subprocess.run(["/usr/bin/python3", "-c", _SCRATCH_AS_NOBODY], env=env, cwd="/", capture_output=True,
                       text=True, timeout=120, **who)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    written = ast.literal_eval(out["stdout"])
    for d in ("/work", "/tmp", "/dev/shm"):
        assert written[d][1] == errno.ENOSPC and written[d][0] <= 8, out  # stopped at the cap, during the run
    assert out["host_bytes"] == 0 and out["collected"] == "x" and out["next"] == ""
    assert any("size-capped tmpfs" in n for n in out["notes"]), out["notes"]
    assert any("cgroup v2: " in n for n in out["notes"]), out["notes"]  # what v2 offers (or not), said


# ------------------------------------------------------------------------------ slot uid leases, node-wide
_LEASE_JOB = """
import sys
from megatron_rl.envs.sandbox._linux import UidLease
try:
    lease = UidLease(int(sys.argv[1]), count=1)
except RuntimeError:
    print("busy", flush=True)
    sys.exit(0)
print(lease.uid, getattr(lease, "dir", "?"), flush=True)
sys.stdin.read()  # hold the lease until told (or killed)
lease.release()
"""


def _lease_job(repo_root, tmpdir: Path, base: int, who: dict) -> subprocess.Popen:
    """A 'Slurm job' on this node: a process of its own with a TMPDIR of its own, leasing one uid."""
    tmpdir.mkdir(mode=0o777)
    os.chmod(tmpdir, 0o777)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo_root), "TMPDIR": str(tmpdir), "LANG": "C.UTF-8"}
    return subprocess.Popen(["/usr/bin/python3", "-c", _LEASE_JOB, str(base)], env=env, cwd="/", text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, **who)


@pytest.mark.parametrize("as_nobody", [False, pytest.param(True, marks=needs_root)])
def test_two_jobs_with_their_own_tmpdir_never_lease_the_same_uid(repo_root, tmp_path, as_nobody):
    """Slurm gives every job its own TMPDIR: a lease registry under it let two jobs on one node lease one uid.
    The registry is node-wide, so the second job finds the uid taken; when the holder is killed (a crash) the
    kernel drops its lock and the uid is leased again. As root and as uid 65534 (its own folder under /run/lock)."""
    who = dict(user=65534, group=65534, extra_groups=[]) if as_nobody else {}
    os.chmod(tmp_path, 0o755)
    base = 3_900_000 + (os.getpid() % 1000) * 4 + as_nobody  # a uid no sandbox of a concurrent test run leases
    a = _lease_job(repo_root, tmp_path / "job-a", base, who)
    uid, lease_dir = a.stdout.readline().split()
    assert int(uid) == base and not lease_dir.startswith((str(tmp_path), tempfile.gettempdir()))
    b = _lease_job(repo_root, tmp_path / "job-b", base, who)
    assert b.communicate("", timeout=60)[0].strip() == "busy"  # other TMPDIR, same node: the uid is held
    a.kill()
    a.wait(timeout=30)
    c = _lease_job(repo_root, tmp_path / "job-c", base, who)
    assert c.communicate("", timeout=60)[0].split()[0] == str(base)  # a dead holder's lease is reclaimed
    assert not os.path.exists(os.path.join(lease_dir, str(base)))  # released: its file is gone


def test_lease_registry_that_others_could_write_or_redirect_is_refused(tmp_path):
    from megatron_rl.envs.sandbox._linux import LeaseDirError, UidLease

    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o777)
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    for bad in ("shared", "link"):
        with pytest.raises(LeaseDirError, match=f"lease folder .*{bad}.*sandbox.lease_dir"):
            UidLease(3_950_000, count=4, directory=str(tmp_path / bad))
    mine = tmp_path / "mine"
    lease = UidLease(3_950_000, count=1, directory=str(mine))  # made 0700, owned by this uid
    assert lease.uid == 3_950_000 and os.listdir(mine) == ["3950000"]
    lease.release()
    os.symlink(tmp_path / "victim", mine / "3950000")  # a planted link is skipped, never followed
    with pytest.raises(RuntimeError, match="no free sandbox uid"):
        UidLease(3_950_000, count=1, directory=str(mine))
    assert not os.path.lexists(tmp_path / "victim")


@needs_root
def test_sandbox_config_lease_dir_holds_the_slot_uids(tmp_path):
    """Set from the run config (`data.sandbox_lease_dir`), as a job in a container with a private /run would."""
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    leases = tmp_path / "leases"
    cfg = C.load(RunConfig, None, [f"data.sandbox_lease_dir={leases}", "data.sandbox_workers=1"]).data.sandbox_config()
    cfg.prespawn = False
    with build_sandbox(cfg) as s:
        assert sorted(os.listdir(leases)) == [str(u) for u in s.uids] and s.run(["id", "-u"]).stdout == "1000\n"
    assert os.listdir(leases) == []


# ------------------------------------------------------------------- a run's leftovers never reach the next
_LEAVE = ("echo x > /work/left; echo y > /tmp/left; echo z > /dev/shm/left; "
          "setsid sleep 120 >/dev/null 2>&1 < /dev/null & echo ran")
_LOOK = "ls -A /work /tmp /dev/shm | grep -c left; true"


@pytest.mark.parametrize("prespawn", [False, True])
def test_bad_collect_refused_before_the_program_runs_and_an_error_leaves_nothing(prespawn, monkeypatch):
    """`collect` names are checked before the program runs (a `..` name used to be refused after it ran, and
    the failed run's files stayed in the slot for its next run); a run that fails after its program ran (a
    worker bug, simulated) leaves no file and no process to the slot's later runs either."""
    import megatron_rl.envs.sandbox.bwrap as bw

    with BwrapSandbox(prespawn=prespawn) as s:
        errors = []
        for bad in (["../x"], ["/etc/passwd"], ["ok", "a/../../b"], "out.txt"):
            with pytest.raises(ValueError) as e:
                s.run(_LEAVE, collect=bad)
            errors.append(str(e.value))
        for _ in range(2):  # with prespawn two slots alternate: each must be seen again
            r = s.run(_LOOK)
            assert r.stdout == "0\n" and s.leftover_processes() == [], r
        assert all("collect" in e for e in errors), errors
        real = bw.collect_files

        def broken(*a, **k):
            raise RuntimeError("simulated worker bug after the program ran")

        monkeypatch.setattr(bw, "collect_files", broken)
        with pytest.raises(RuntimeError, match="simulated"):
            s.run(_LEAVE)
        monkeypatch.setattr(bw, "collect_files", real)
        for _ in range(3):
            r = s.run(_LOOK)
            assert r.stdout == "0\n" and s.leftover_processes() == [], r


def test_pool_and_subprocess_backend_refuse_bad_collect_before_running(tmp_path):
    marker = tmp_path / "ran"
    with pytest.warns(RuntimeWarning):
        sp = SubprocessSandbox()
    with pytest.raises(ValueError, match="collect"):
        sp.run(f"touch {marker}", collect=["../../etc/passwd"])
    assert not marker.exists()
    p = SandboxPool(lambda i: sp, workers=1)
    try:
        with pytest.raises(ValueError, match="collect"):
            p.submit(f"touch {marker}", collect=["/etc/passwd"])
    finally:
        p.close()
    assert not marker.exists()
