"""First sandbox of a new image on a node (cold node cache) against the same with a warm cache.

The image: numpy (copied from this interpreter's site-packages, ~75 MB in ~1,000 files: a typical per-domain
tool set; the host's /usr/bin/python3 does not have it) built once into the store (`envs.sandbox.image.build`).
Then, per trial, in one process:
- cold: the node cache emptied, then `SandboxConfig(layer=<image file>).build()` (extract into the cache, set up
  the sandbox) and its first run of `python3 -c "import numpy"`;
- warm: the same with the cache already filled (what every later worker on the node pays);
- bare: a sandbox without image and its first run of `python3 -c pass` (the baseline: sandbox set-up alone).
Prints ONE JSON object (medians over --trials, seconds; ratios against the warm and bare figures measured in
the same run). Other work on the machine slows every figure; the load average is included.

    .venv/bin/python benchmarks/sandbox_image.py [--trials 5] [--fmt sqfs|tar]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.envs.sandbox import SandboxConfig  # noqa: E402
from megatron_rl.envs.sandbox.image import ImageSpec, build, has_squashfs  # noqa: E402


def first_run(cfg: SandboxConfig, command: str) -> tuple[float, float]:
    """(seconds from build() to the end of the first run, of which the run itself)."""
    t0 = time.perf_counter()
    sb = cfg.build()
    try:
        t1 = time.perf_counter()
        r = sb.run(command)
        if not r.ok:
            raise RuntimeError(f"benchmark run failed: {r}")
        t2 = time.perf_counter()
    finally:
        sb.close()
    return t2 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--fmt", default="sqfs" if has_squashfs() else "tar", choices=["sqfs", "tar"])
    args = ap.parse_args()
    import numpy

    site = Path(numpy.__file__).resolve().parents[1]
    files = {f"/usr/local/lib/python3.11/dist-packages/{p.name}": str(p) for p in sorted(site.glob("numpy*"))}
    base = tempfile.mkdtemp(prefix="mrl-bench-image-")
    os.chmod(base, 0o755)
    load0 = os.getloadavg()
    try:
        t = time.perf_counter()
        image = build(ImageSpec(name="numpy", files=files), os.path.join(base, "store"), fmt=args.fmt)
        build_s = time.perf_counter() - t
        cache = os.path.join(base, "cache")
        cfg = SandboxConfig(layer=image, image_cache=cache, prespawn=False)
        probe = "python3 -I -c 'import numpy; numpy.zeros(3).sum()'"
        cold, warm, bare, warm_run = [], [], [], []
        for _ in range(args.trials):
            shutil.rmtree(cache, ignore_errors=True)
            cold.append(first_run(cfg, probe)[0])
            w, wr = first_run(cfg, probe)
            warm.append(w)
            warm_run.append(wr)
            bare.append(first_run(SandboxConfig(prespawn=False), "python3 -I -c pass")[0])
        med = statistics.median
        out = {"benchmark": "sandbox_image", "format": args.fmt, "image_bytes": os.path.getsize(image),
               "image_files": sum(len(f) for _, _, f in os.walk(os.path.join(cache, os.listdir(cache)[0]))),
               "trials": args.trials, "build_s": round(build_s, 3),
               "cold_first_sandbox_s": round(med(cold), 4), "warm_first_sandbox_s": round(med(warm), 4),
               "warm_run_s": round(med(warm_run), 4), "bare_first_sandbox_s": round(med(bare), 4),
               "cold_vs_warm": round(med(cold) / med(warm), 2), "warm_vs_bare": round(med(warm) / med(bare), 2),
               "loadavg_before": [round(x, 2) for x in load0],
               "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
