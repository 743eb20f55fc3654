"""Sandboxed executions per second of a small unit-test program, and per-run latency against bare python3.

The program is what the code environment runs: a function and five asserts. Measured in one process:
- bare: `python3 main.py` as a plain subprocess (pipes captured), the baseline;
- sandbox latency: back-to-back `BwrapSandbox.run` calls (default prespawn on; and cold, prespawn off),
  interleaved in blocks with the bare runs so that all three see the same background load;
- code reward: `envs.code.verifier.run_unit_tests` of the same function and asserts (a candidate sandbox
  run, then the verdict from the verifier zygote: a pristine sandboxed process forking one child per verdict;
  the task's call plan cached as in training), interleaved too; its CPU includes the zygote's (read from
  /proc: the worker reaps those processes only when the service ends);
- code reward with a verifier sandbox per verdict (`reward_per_run`: the path of backends without a zygote,
  and of this code before it), interleaved too, as the baseline of the zygote's gain;
- throughput: a `SandboxPool` of 1..4 workers fed all jobs at once.
Where a code reward's CPU goes (2-core shared machine, load 7-20, so +-20%; children's CPU with the worker as
subreaper): worker's own Python per sandbox run ~4 ms (files, pump, cgroup, slot reset, prespawn thread);
starting bwrap through sh/nsenter/prlimit/setpriv (the default, vfork) ~1.5 ms whatever the worker's size,
where forking the worker to run the same steps costs ~3 ms in a small worker and ~130 ms with 2 GB of
touched RSS (`--worker-rss-mb`: page tables copied by fork and torn down by exec); bwrap itself ~5 ms
(user+mount namespaces and binds ~2.6, ipc/pid/uts/cgroup namespaces, tmpfs, remount ~1, --dev ~0.7, seccomp
~0.6, the trampoline shell ~0.1; a fresh network namespace would add ~0.9, a slot reuses its own);
`python3 -I -S` start ~11-13 ms; the verdict from the zygote ~4 ms (fork, tests, exit), against ~27-31 ms
for a verifier sandbox per verdict.
Targets (from the issues): latency <= 1.5x bare, code reward <= 2.5x bare, >= 45 runs/s on 2 cores. Prints ONE
JSON object. The load average before and after is included: other work on the machine slows every figure.

    .venv/bin/python benchmarks/sandbox_throughput.py [--runs 300] [--blocks 15] [--python-args "-I -S"]
        [--worker-rss-mb 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.envs.code.verifier import _VERIFIER_ZYGOTE, _ZYGOTE_NAME, run_unit_tests  # noqa: E402
from megatron_rl.envs.sandbox import Sandbox, SandboxJob, SandboxPool  # noqa: E402
from megatron_rl.envs.sandbox.bwrap import BwrapSandbox  # noqa: E402

PROGRAM = """\
def fizzbuzz(n):
    return "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n)


assert fizzbuzz(1) == "1"
assert fizzbuzz(3) == "Fizz"
assert fizzbuzz(10) == "Buzz"
assert fizzbuzz(30) == "FizzBuzz"
assert [fizzbuzz(i) for i in range(1, 6)] == ["1", "2", "Fizz", "4", "Buzz"]
"""
SOLUTION, _, _ASSERTS = PROGRAM.partition("\n\n\n")
TESTS = _ASSERTS.strip().splitlines()
PYTHON = "/usr/bin/python3"  # the interpreter the sandbox sees (host /usr), so both sides run the same one


class Bare:
    """The baseline: `python3 main.py` as a plain subprocess in a directory holding the program."""

    def __init__(self, py_args: list[str]):
        self.dir = tempfile.TemporaryDirectory()
        Path(self.dir.name, "main.py").write_text(PROGRAM)
        self.argv = [PYTHON, *py_args, "main.py"]

    def run(self) -> None:
        r = subprocess.run(self.argv, cwd=self.dir.name, capture_output=True)
        assert r.returncode == 0, r.stderr


class _NoZygote(Sandbox):
    """A sandbox without a zygote: the code reward runs one verifier sandbox per verdict."""

    def __init__(self, inner: Sandbox):
        self.inner = inner

    def run(self, *a, **kw):
        return self.inner.run(*a, **kw)


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def cpu_s() -> float:
    """CPU time of this process and its reaped children (bwrap, its pid 1 and the program are all reaped
    here or below); async kernel work such as network-namespace cleanup is not included."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def latencies(blocks: int, block: int, py_args: list[str]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Interleaved blocks of back-to-back runs (bare, sandbox with prespawn, sandbox cold), so that the
    three see the same background load; within a block runs follow each other without pause. Also the CPU
    seconds per run of each (less sensitive to other load than wall time)."""
    bare = Bare(py_args)
    out: dict[str, list[float]] = {"bare": [], "warm": [], "cold": [], "reward": [], "reward_per_run": []}
    cpu = {k: 0.0 for k in out}
    with BwrapSandbox(prespawn=True) as warm, BwrapSandbox(prespawn=False) as cold, \
            BwrapSandbox(prespawn=True) as rewarder, BwrapSandbox(prespawn=True) as per_run:
        def sandboxed(sb):
            def run() -> None:
                r = sb.run_python(PROGRAM, python=PYTHON, python_args=tuple(py_args))
                assert r.ok, r
            return run

        def reward(sb) -> Callable[[], None]:
            def run() -> None:
                results, reason, status = run_unit_tests(sb, SOLUTION, TESTS)
                assert status == "ok" and all(p for p, _ in results), (results, reason)
            return run
        runs = {"bare": bare.run, "warm": sandboxed(warm), "cold": sandboxed(cold), "reward": reward(rewarder),
                "reward_per_run": reward(_NoZygote(per_run))}
        for fn in runs.values():
            timed(fn, 3)  # warm-up: page cache, first mounts, the zygote's start
        zygote = rewarder.zygote(_ZYGOTE_NAME, _VERIFIER_ZYGOTE)
        for _ in range(blocks):
            for name, fn in runs.items():
                c0, z0 = cpu_s(), zygote.cpu_s()
                out[name] += timed(fn, block)
                cpu[name] += cpu_s() - c0 + zygote.cpu_s() - z0
        assert zygote.starts == 1, f"the verifier zygote restarted ({zygote.starts} starts)"
    bare.dir.cleanup()
    return out, {k: v / (blocks * block) for k, v in cpu.items()}


def pool_throughput(workers: int, runs: int, py_args: list[str]) -> float:
    job = SandboxJob(command=[PYTHON, *py_args, "main.py"], files={"main.py": PROGRAM})
    with SandboxPool(lambda i: BwrapSandbox(), workers) as pool:
        pool.map([job] * (2 * workers))  # warm-up
        t0 = time.perf_counter()
        results = pool.map([job] * runs)
        dt = time.perf_counter() - t0
    assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
    return runs / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=300, help="jobs per throughput measurement")
    ap.add_argument("--blocks", type=int, default=15, help="interleaved latency blocks")
    ap.add_argument("--block", type=int, default=10, help="back-to-back runs per latency block")
    ap.add_argument("--python-args", default="", help="interpreter options for both sides, e.g. '-I -S'")
    ap.add_argument("--max-workers", type=int, default=4)
    ap.add_argument("--worker-rss-mb", type=int, default=0,
                    help="touched ballast in the measuring process, like a rollout worker's resident memory: a "
                         "sandbox start forks the worker (bwrap's preexec), bare python3 does not (vfork)")
    args = ap.parse_args()
    ballast = bytearray(args.worker_rss_mb << 20)  # zero-filled: every page touched
    py_args = shlex.split(args.python_args)
    load_before = os.getloadavg()
    lat, cpu = latencies(args.blocks, args.block, py_args)
    bare, warm, cold, rew, rew_old = (statistics.median(lat[k]) for k in ("bare", "warm", "cold", "reward",
                                                                         "reward_per_run"))
    tput = {str(w): round(pool_throughput(w, args.runs, py_args), 1) for w in range(1, args.max_workers + 1)}
    best = max(tput.values())
    ratio = warm / bare
    print(json.dumps({
        "program": "function + 5 asserts", "python": PYTHON, "python_args": py_args, "cpus": os.cpu_count(),
        "latency_runs_each": len(lat["bare"]), "bare_median_ms": round(bare * 1e3, 2),
        "sandbox_median_ms": round(warm * 1e3, 2), "sandbox_cold_median_ms": round(cold * 1e3, 2),
        "overhead_ratio": round(ratio, 3), "overhead_ratio_cold": round(cold / bare, 3),
        "code_reward_median_ms": round(rew * 1e3, 2), "code_reward_ratio": round(rew / bare, 3),
        "code_reward_per_run_verifier_median_ms": round(rew_old * 1e3, 2),
        "code_reward_per_run_verifier_ratio": round(rew_old / bare, 3),
        "cpu_ms_per_run": {k: round(v * 1e3, 2) for k, v in cpu.items()},
        "code_reward_cpu_ratio": round(cpu["reward"] / cpu["bare"], 3),  # steadier than wall time under load
        "code_reward_per_run_verifier_cpu_ratio": round(cpu["reward_per_run"] / cpu["bare"], 3),
        "cpu_bound_runs_per_s_on_all_cores": round((os.cpu_count() or 1) / cpu["warm"], 1),
        "runs_per_s_by_workers": tput, "best_runs_per_s": best,
        "targets": {"overhead_ratio_max": 1.5, "code_reward_ratio_max": 2.5, "runs_per_s_min": 45},
        "meets_targets": {"overhead": ratio <= 1.5, "code_reward": rew / bare <= 2.5, "throughput": best >= 45},
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "worker_rss_mb_extra": len(ballast) >> 20,
    }))


if __name__ == "__main__":
    main()
