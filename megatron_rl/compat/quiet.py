"""Megatron-Core's known-harmless warnings on machines without CUDA, Transformer Engine or Apex, filtered.

Every process that imports Megatron (the driver's ranks, converters, tests) printed these before its first line
of its own, once per rank: seven lines of "Transformer Engine and Apex are not installed" and a deprecation
Megatron raises against its own default; and on its first step torch's deprecations of the collectives Megatron
calls. Each filter below names one message, where it comes from and why it
is harmless here; anything else (another message, the same text from another module, another category) still
shows. `install()` is called by `megatron_rl/__init__.py`, so before Megatron is imported in every process of
this package; `MEGATRON_RL_SHOW_WARNINGS=1` leaves them all visible.
`tests/compat/test_quiet_start.py` checks that each filter still matches a warning Megatron raises (an upgrade that
drops one shows here) and that an unknown warning is not filtered.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

ENV_SHOW = "MEGATRON_RL_SHOW_WARNINGS"
"""Set to 1 to install no filter (every warning shows)."""


@dataclass(frozen=True)
class KnownWarning:
    """One filtered warning."""

    name: str
    """Identifier (tests and this list)."""
    message: str
    """Regular expression matched against the start of the warning's text."""
    module: str
    """Regular expression matched against the warning's module (`warnings.filterwarnings(module=...)`)."""
    reason: str
    """Why it is harmless on the machines this filter is for."""
    category: type[Warning] = UserWarning
    """The warning's class."""


KNOWN = (
    KnownWarning("te_apex_fallback", r"Transformer Engine and Apex are not installed\. Falling back to ",
                 r"megatron\.core\.", "CPU machines have neither; the torch implementations it falls back to "
                 "(multi_tensor_applier, the torch optimizers) are the ones this project runs and tests on CPU"),
    KnownWarning("apex_norm_fallback", r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\.",
                 "no Apex on CPU; the torch norm is what the local layer spec uses (megatron_rl.compat.cpu "
                 "makes it accept sequence parallelism)"),
    KnownWarning("cuda_graph_full_scope", r"full scope is deprecated", r"megatron\.core\.transformer\.",
                 "TransformerConfig warns against its own default cuda_graph_scope='full' on every model built "
                 "(megatron-core 0.16); this project never sets it nor enables CUDA graphs"),
    *(KnownWarning(f"torch_{name}_deprecated", rf"`torch\.distributed\.{name}` is deprecated",
                   r"torch\.distributed\.c10d_logger", f"torch 2.13 deprecates {name} (in favour of the *_single "
                   "names) and Megatron-Core 0.16 calls it on every step; the warning is raised in torch's own "
                   "wrapper, so it cannot be told apart by caller: this project's code calls the new names or "
                   "Megatron's helpers", FutureWarning)
      for name in ("all_gather_into_tensor", "reduce_scatter_tensor")),
)


def install() -> None:
    """Add one `ignore` filter per known warning (idempotent; nothing with MEGATRON_RL_SHOW_WARNINGS=1)."""
    if os.environ.get(ENV_SHOW) == "1":
        return
    for w in KNOWN:
        warnings.filterwarnings("ignore", message=w.message, category=w.category, module=w.module)
