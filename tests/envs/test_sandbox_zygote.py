"""The verifier zygote (`envs.sandbox.zygote`): a pristine sandboxed process forking one child per request,
which the code reward uses for its verdicts through `make_env("code").step(...)`."""
from __future__ import annotations

import time

import pytest

import envs  # noqa: F401  (registers the built-ins)
from envs.base import make_env
from envs.code import verifier as V
from envs.sandbox.base import Limits
from envs.sandbox.bwrap import BwrapSandbox
from envs.sandbox.zygote import Zygote, ZygoteError
from envs.tasks import load_domain

ECHO = """
SEEN = []
def handle(request):
    if request == b"hang":
        while True:
            pass
    if request == b"crash":
        os._exit(7)
    if request == b"memory":
        hog = bytearray(1 << 30)
        return bytes(len(hog))
    SEEN.append(request)  # a pristine child: every request sees an empty list first
    return b"%d %d %s" % (len(SEEN), os.getpid(), request)

serve(handle)
"""


@pytest.fixture(scope="module")
def sandbox():
    with BwrapSandbox() as sb:
        yield sb


def code_reward(sandbox, tid: str, solution: str) -> float:
    env = make_env("code", sandbox=sandbox)
    env.reset(next(t for t in load_domain("code") if t.id == tid))
    r = env.step("```python\n" + solution + "\n```")
    assert r.reward_result.valid, r.reward_result.reasons
    return r.reward


def test_code_reward_verdicts_come_from_one_pristine_zygote(sandbox):
    """Through the environment's public path: right and wrong solutions score 1 and 0, the verdicts come from
    one zygote service (started once, one fork per verdict) whose CPU is visible to benchmarks."""
    gcd = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n"
    assert code_reward(sandbox, "code-gcd", gcd) == 1.0
    assert code_reward(sandbox, "code-gcd", "def gcd(a, b):\n    return -7\n") == 0.0
    for _ in range(12):  # enough verdicts (~4 ms of CPU each) to show in /proc's 10 ms clock ticks
        assert code_reward(sandbox, "code-gcd", gcd) == 1.0
    z = sandbox.zygote(V._ZYGOTE_NAME, V._VERIFIER_ZYGOTE)
    assert z.starts == 1 and z.calls >= 14, (z.starts, z.calls)
    assert z.cpu_s() > 0


def test_candidate_cannot_reach_the_verifier_zygote(sandbox):
    """The candidate looks for the verifier's process to write a verdict into its channel (it runs in another
    sandbox: another pid namespace and, as root, another uid): nothing found, the wrong answer scores 0 and
    the service was not disturbed."""
    attack = ("import os\n"
              "HIT = []\n"
              "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
              "    try:\n"
              "        cmd = open('/proc/%s/cmdline' % pid, 'rb').read()\n"
              "        if b'zygote' in cmd or b'verify' in cmd:\n"
              "            HIT.append(pid)\n"
              "            for fd in ('0', '1'):\n"
              "                with open('/proc/%s/fd/%s' % (pid, fd), 'wb') as f:\n"
              "                    f.write(b'\\x00' * 8 + b'[[\"pass\",\"\",[]]]')\n"
              "    except OSError:\n"
              "        pass\n"
              "def gcd(a, b):\n    return len(HIT) * 1000 - 1\n")
    z = sandbox.zygote(V._ZYGOTE_NAME, V._VERIFIER_ZYGOTE)
    starts = z.starts
    assert code_reward(sandbox, "code-gcd", attack) == 0.0
    gcd = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n"
    assert code_reward(sandbox, "code-gcd", gcd) == 1.0
    assert z.starts == max(starts, 1)


@pytest.mark.slow
def test_zygote_children_are_pristine_and_failures_restart_it(sandbox):
    """Every request is served by a fresh child (state from an earlier request is not there); a request that
    hangs, crashes or runs out of memory is an error within its wall limit, the service is restarted and no
    process of the old one is left."""
    z = Zygote(sandbox._sibling, ECHO)
    try:
        limits = Limits(wall_s=2.0, cpu_s=5.0, memory_mb=128)
        answers = [z.call(b"r%d" % i, limits).split() for i in range(3)]
        assert [a[0] for a in answers] == [b"1"] * 3 and len({a[1] for a in answers}) == 3, answers
        assert [a[2] for a in answers] == [b"r0", b"r1", b"r2"]
        for request, kind in ((b"hang", "timeout"), (b"crash", "error"), (b"memory", "error")):
            t0 = time.monotonic()
            with pytest.raises(ZygoteError) as e:
                z.call(request, limits)
            assert e.value.kind == kind and time.monotonic() - t0 < 10, (request, e.value)
            assert z._sandbox.processes() == [], request  # the old service is gone, with its children
            assert z.call(b"after", limits).split()[0] == b"1"
        assert z.starts == 4, z.starts
    finally:
        z.close()
    assert z._sandbox is None


def test_zygote_compiles_its_source_for_another_bytecode_format(sandbox):
    """A sandbox interpreter with another magic number compiles the script's source instead of the worker's
    bytecode."""
    z = Zygote(sandbox._sibling, ECHO)
    try:
        z._files["zygote.pyc"] = b"\0\0\r\n" + z._files["zygote.pyc"][4:]
        z._files["zygote.py"] = z._files["zygote.py"].replace(b"%d %d %s", b"src %d %d %s")
        assert z.call(b"x", Limits(wall_s=5.0)).split()[:2] == [b"src", b"1"]
    finally:
        z.close()


def test_pool_verdicts_come_from_its_slots_zygotes():
    """With `sandbox.workers > 1` (a SandboxPool) the code reward's verdicts come from the slots' zygotes too,
    concurrent rewards each taking a free one."""
    from concurrent.futures import ThreadPoolExecutor

    from envs.sandbox import SandboxPool

    gcd = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n"
    with SandboxPool(lambda i: BwrapSandbox(), 2) as pool:
        with ThreadPoolExecutor(2) as ex:
            rewards = list(ex.map(lambda s: code_reward(pool, "code-gcd", s), [gcd, "def gcd(a, b):\n    return -7\n"]
                                  * 2))
        assert rewards == [1.0, 0.0, 1.0, 0.0]
        zs = pool.zygote(V._ZYGOTE_NAME, V._VERIFIER_ZYGOTE)
        assert len(zs.zygotes) == 2 and sum(z.calls for z in zs.zygotes) == 4
        assert all(z.starts <= 1 for z in zs.zygotes)
