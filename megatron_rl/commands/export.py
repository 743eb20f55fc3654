"""`megatron-rl export RUN_DIR [--step N] [--out DIR] [--verify]`: an RL run's policy as a Hugging Face folder.

Reads the run's checkpoint (the latest, or RL step N) and writes safetensors, config.json (the architecture
of the run's model: the model.init checkpoint's own config.json with the policy's dtype; or, for a model made
from random weights, the first architecture whose config.json describes it exactly: Llama for a plain dense one,
Mixtral for an MoE with every layer MoE, ...; `megatron_rl.convert.arch.describe`), the tokenizer files of the run's
tokenizer with the eos / bos / pad tokens and tokenizer class every HF tool reads alike
(`megatron_rl.convert.tokenizer_files`: eos = the chat template's end of turn, also in generation_config.json;
a byte tokenizer's stop ids for a model without one). Only the policy's weights are
read (the optimizer state in the checkpoint is ignored), one layer at a time. The folder is written atomically
(default: <run>/export/hf-step-N). `--verify` loads it with transformers' `from_pretrained` and checks that
every tensor is accounted for and that its logits equal the Megatron policy's on the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-rl export", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("run_dir", help="the run's folder (runs/<name>, holding config.yaml and checkpoints/)")
    p.add_argument("--step", type=int, help="RL step of the checkpoint (default: the latest)")
    p.add_argument("--out", help="output folder (must not exist; default <run>/export/hf-step-N)")
    p.add_argument("--verify", action="store_true", help="load with transformers and compare logits")
    p.add_argument("--tol", type=float, help="largest logit difference for --verify (default by dtype)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a Hugging Face PEFT folder (default <run>/export/"
                        "adapter-step-N) instead of the merged model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.config import ConfigError
    from megatron_rl.convert.arch.base import ConvertError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = export_run(Path(args.run_dir), args.step, args.out, args.verify, args.tol, adapter=args.adapter)
    except (ConvertError, ConfigError, FileNotFoundError) as e:
        print(f"megatron-rl export: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report), flush=True)
    return 0


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    from megatron_rl.loop.state import latest

    path = latest(run_dir) if step is None else run_dir / "checkpoints" / f"step-{step:06d}"
    if path is None or not (path / "metadata.json").is_file():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() \
            else []
        raise FileNotFoundError(f"no checkpoint {'of step ' + str(step) if step is not None else ''} in {run_dir} "
                                f"(have: {have or 'none'}); train first or pick a --step from that list")
    return path


def default_out(run_dir: Path, ckpt: Path, adapter: bool = False) -> Path:
    return run_dir / "export" / f"{'adapter' if adapter else 'hf'}-step-{int(ckpt.name.split('-')[-1])}"


def hf_config_of(cfg) -> tuple[dict, str]:
    """(config.json of the exported folder, tokenizer folder or '') for a run config."""
    from megatron_rl.convert import source
    from megatron_rl.convert.arch import describe

    if cfg.model.init:
        hf = dict(source.hf_config(cfg.model.init))
    else:  # the first architecture that describes the random model exactly (Llama for a plain dense one)
        hf = describe(cfg.model, {"layernorm_epsilon": cfg.model.norm_epsilon, "kv_channels": cfg.model.head_dim})[1]
    hf.pop("torch_dtype", None)
    hf["dtype"] = hf["torch_dtype"] = _DTYPE[cfg.model.params_dtype]
    return hf, cfg.tokenizer.resolved_path(cfg.model)


def export_run(run_dir: Path, step: int | None = None, out: str | None = None, verify: bool = False,
               tol: float | None = None, replace: bool = False, adapter: bool = False) -> dict:
    """Write the HF folder; returns {step, out, tensors, side_files, verify?}. `replace`: an existing folder of
    that name (an earlier export of the same step, e.g. before a crash and resume) is replaced once the new one
    is complete. `adapter`: a LoRA run's PEFT adapter folder instead (commands/lora_export.py)."""
    import shutil

    dest = Path(out) if out else None
    if replace and dest is not None and dest.exists():
        fresh = dest.with_name(dest.name + ".new")
        shutil.rmtree(fresh, ignore_errors=True)
        report = export_run(run_dir, step, str(fresh), verify, tol, adapter=adapter)
        shutil.rmtree(dest)
        fresh.rename(dest)
        return {**report, "out": str(dest), "replaced": True}
    from megatron_rl import config as C
    from megatron_rl.convert import runtime
    from megatron_rl.convert.arch import for_hf_config
    from megatron_rl.convert.convert import all_rules, ckpt_layout
    from megatron_rl.convert.hf_io import copy_side_files
    from megatron_rl.convert.tokenizer_files import normalize as normalize_tokenizer_files
    from megatron_rl.run_config import RunConfig

    cfg = C.load(RunConfig, run_dir / "config.yaml")
    ckpt = checkpoint_of(run_dir, step)
    if replace and out is None:
        return export_run(run_dir, step, str(default_out(run_dir, ckpt, adapter)), verify, tol, replace=True,
                          adapter=adapter)
    n = int(ckpt.name.split("-")[-1])
    hf, tok_dir = hf_config_of(cfg)
    arch = for_hf_config(hf)
    dest = Path(out) if out else default_out(run_dir, ckpt, adapter)
    report = {"step": n, "checkpoint": str(ckpt), "out": str(dest), "arch": arch.name}
    if cfg.lora.enabled and (adapter or verify):
        if verify:
            raise C.ConfigError("--verify compares a full checkpoint with the folder; a LoRA run's checkpoint "
                                "holds adapters only: export without --verify")
        from megatron_rl.commands.lora_export import export_lora_run

        return {**report, **export_lora_run(cfg, ckpt, dest, hf, arch)}
    if adapter:
        raise C.ConfigError(f"--adapter exports LoRA adapters, but {run_dir} trained without lora.enabled")
    mcfg, extra = arch.model_config(hf)
    ctx = runtime.start()
    entries, dtypes = ckpt_layout(ckpt, arch, mcfg, extra, ctx) if not cfg.lora.enabled else (None, None)
    with runtime.atomic_dir(dest, ctx.world) as tmp:
        report["tensors"] = _write_tensors(tmp, cfg, ckpt, entries, dtypes, arch, hf)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        report["side_files"] = copy_side_files(Path(tok_dir), tmp) if tok_dir else []
        if tok_dir:  # eos = the template's end of turn, bos, pad, tokenizer class: read alike by every HF tool
            report["tokenizer_files_fixed"] = normalize_tokenizer_files(tmp)
        else:
            _generation_config(tmp, cfg, hf)
        if verify:
            from megatron_rl.convert import verify as V

            copies = frozenset(c for names in arch.shared_copies(hf).values() for c in names)
            report["verify"] = V.verify_hf_folder(tmp, ckpt, mcfg, extra, all_rules(arch, hf), tol, copies)
    return report


def _write_tensors(tmp: Path, cfg, ckpt: Path, entries, dtypes, arch, hf: dict) -> int:
    """The policy's HF tensors into `tmp`: from the checkpoint, or for a LoRA run the base merged with its
    adapters (commands/lora_export.py)."""
    from megatron_rl.convert.convert import export_hf
    from megatron_rl.convert.hf_io import HFWriter

    if cfg.lora.enabled:
        from megatron_rl.commands.lora_export import read_adapters, write_merged
        from megatron_rl.model_init import parse

        return write_merged(tmp, parse(cfg.model.init)[1], read_adapters(ckpt), cfg.lora, arch, hf)
    writer = HFWriter(tmp)
    export_hf(ckpt, entries, dtypes, arch, hf, writer, False)
    return len(writer.finish())


def _generation_config(folder: Path, cfg, hf: dict) -> None:
    """generation_config.json of a model without an HF tokenizer folder (the byte tokenizer): its stop ids as
    eos (merged into one the model already had)."""
    tok = cfg.tokenizer.build(cfg.model)
    f = folder / "generation_config.json"
    gen = json.loads(f.read_text()) if f.is_file() else {}
    gen.update({"eos_token_id": list(tok.stop_ids) if len(tok.stop_ids) > 1 else tok.stop_ids[0],
                "pad_token_id": tok.pad_id, "transformers_version": hf.get("transformers_version", "4.57.6")})
    if "bos_token_id" in hf:
        gen["bos_token_id"] = hf["bos_token_id"]
    f.write_text(json.dumps(gen, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
