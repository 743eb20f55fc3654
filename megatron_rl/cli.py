"""`megatron-rl`: the console entry point.

Each subcommand lives in its own module and is imported only when called, so `--help` is fast and a
missing optional dependency of one tool never breaks another. A subcommand that is not built yet says so
and exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with `main(argv) -> int`, or None when not built yet; one-line help; where it is planned)
SUBCOMMANDS: dict[str, tuple[str | None, str, str]] = {
    "train": ("megatron_rl.commands.train", "run RL post-training from a YAML config (the main job)", ""),
    "rollout-worker": ("megatron_rl.dispatch.worker", "run a batch of environment episodes and write HDF5 shards",
                       ""),
    "convert": ("megatron_rl.tools.convert.cli", "convert checkpoints HF <-> Megatron (dist_checkpointing) and reshard",
                ""),
    "plan": ("megatron_rl.tools.plan", "memory and parallel-layout planner for a config (up to 1T-parameter MoE)", ""),
    "inspect": ("megatron_rl.data.inspect", "summarise trajectory shards (counts, rewards, lengths, versions)", ""),
    "report": ("megatron_rl.commands.report", "plot a run's rewards, lengths, time split and per-domain held-out "
               "success (table + heat map)", ""),
    "eval": ("megatron_rl.commands.eval", "evaluate a checkpoint on held-out tasks (pass@k per domain)", ""),
    "export": ("megatron_rl.commands.export", "write an RL run's policy as a Hugging Face folder (safetensors)", ""),
}

NOT_BUILT_EXIT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.split("\n\n")[0].strip("`: "))
    p.add_argument("--version", action="version", version=f"megatron-rl {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text, planned) in SUBCOMMANDS.items():
        suffix = "" if module else f" [not built yet: {planned}]"
        sp = sub.add_parser(name, help=help_text + suffix, add_help=False,
                            description=help_text + suffix)
        sp.add_argument("-h", "--help", action="store_true", help="show this command's help and exit")
        sp.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _version() -> str:
    from megatron_rl import __version__

    return __version__


def run_subcommand(name: str, argv: list[str], show_help: bool) -> int:
    module, help_text, planned = SUBCOMMANDS[name]
    if module is None:
        msg = f"megatron-rl {name}: {help_text}.\nNot built yet (planned in {planned}); nothing was done."
        print(msg, file=sys.stdout if show_help else sys.stderr)
        return NOT_BUILT_EXIT
    main = importlib.import_module(module).main
    return int(main((["--help"] if show_help else []) + argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:  # top-level --help/--version, or an unknown command
        parser.parse_args(argv)
        parser.print_help()
        return NOT_BUILT_EXIT
    name, rest = argv[0], argv[1:]  # everything after the command goes to it untouched (options first too)
    show_help = rest[:1] in (["-h"], ["--help"])
    try:
        return run_subcommand(name, rest[1:] if show_help else rest, show_help)
    except SystemExit as e:  # argparse inside a subcommand (--help, usage errors)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
