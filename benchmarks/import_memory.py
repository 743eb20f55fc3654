"""Peak memory of `megatron-rl convert hf-to-mcore` (one rank) against the model's size and against a baseline
measured in the same run: the same conversion as it was before (tensors read through `safetensors.safe_open`,
memory-mapped, into a model built with Megatron's random CPU initialisation), reproduced here by swapping the
reader and the build back in (`--child mmap_init`).

Each side runs in a fresh child process; its peak RSS (VmHWM) is reset after the imports of the modules the
conversion uses and the start of its (one-rank) process group (/proc/self/clear_refs, 5) and read at the end, so
the figures count the conversion's own memory above the interpreter + torch + Megatron-Core (printed as base_mb).
The import reads each safetensors tensor with a positioned read (no memory
map) into a model built without random initialisation, then saves with dist_checkpointing, the views among the
saved tensors (fc1's GLU halves) cloned one parameter at a time, that parameter's memory released
(`convert.releasing_state_dict`; Megatron's writer would clone them all at once). After each tensor is filled,
its temporaries' freed heap goes back to the OS (`runtime.release_freed_memory`, glibc malloc_trim: without it
glibc kept ~42 MB of them resident, 1.067-1.081x).

    .venv/bin/python benchmarks/import_memory.py [--hf models/SmolLM2-135M-Instruct]

Target (issue 17, item 4): peak <= this rank's shard (here the whole model) + one layer. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status() -> dict[str, int]:
    """VmHWM / VmRSS of this process in bytes."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


class _MmapFile:
    """The previous reader: safe_open (memory-mapped), tensors read through it."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.f = safe_open(path, "pt")
        self.entries = {k: None for k in self.f.keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.f.get_slice(name).get_shape())

    def read(self, name: str):
        return self.f.get_tensor(name)

    def close(self) -> None:
        self.f = None


def _previous_path() -> None:
    """Swap the memory-mapped reader, the randomly initialised build and the heap kept after each tensor back into
    the converter."""
    from megatron_rl.convert import convert, hf_io, layout, runtime

    hf_io.SafetensorsFile = _MmapFile
    runtime.release_freed_memory = lambda: None
    build = layout.build_model
    convert.layout.build_model = lambda cfg, extra, ctx, **kw: build(
        cfg, {k: v for k, v in extra.items() if k != "perform_initialization"}, ctx, **kw)


def _child(side: str, hf: str, out: str) -> None:
    # imports and the process group before the reset: the base (code, not the conversion's memory)
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    from megatron_rl.convert import runtime
    from megatron_rl.convert.convert import hf_to_mcore

    runtime.start()
    if side == "mmap_init":
        _previous_path()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base = _status()["VmRSS"]
    hf_to_mcore(hf, out)
    print(json.dumps({"base": base, "peak": _status()["VmHWM"]}))


def model_bytes(hf: str) -> int:
    """Bytes of every tensor in the folder's safetensors (from their headers)."""
    from megatron_rl.convert.hf_io import SafetensorsFile

    total = 0
    for f in sorted(Path(hf).glob("*.safetensors")):
        st = SafetensorsFile(f)
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in st.entries.values())
        st.close()
    return total


def run(side: str, hf: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, __file__, "--child", side, "--hf", hf, "--out", f"{tmp}/ckpt"],
                              capture_output=True, text=True, cwd=REPO, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--child", choices=("import", "mmap_init"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.child:
        return _child(a.child, a.hf, a.out)
    size = model_bytes(a.hf)
    imp, base = run("import", a.hf), run("mmap_init", a.hf)
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    above = {"import": imp["peak"] - imp["base"], "previous": base["peak"] - base["base"]}
    print(json.dumps({"model": a.hf, "model_mb": mb(size), "base_mb": mb(imp["base"]),
                      "import_peak_mb": mb(above["import"]), "previous_peak_mb": mb(above["previous"]),
                      "import_peak_over_model": round(above["import"] / size, 3),
                      "previous_peak_over_model": round(above["previous"] / size, 3),
                      "import_over_previous": round(above["import"] / above["previous"], 3)}))


if __name__ == "__main__":
    main()
