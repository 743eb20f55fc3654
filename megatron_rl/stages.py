"""Pipeline stages: how many transformer layers each model chunk (pipeline rank, virtual stage) holds.

Three ways, each passed through to Megatron-Core (its TransformerConfig field in brackets):
- even (the default): num_layers / (pp * vpp) layers per chunk;
- first/last counts [num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage]: the first (last)
  pipeline rank holds that many layers over its vpp chunks (a multiple of vpp); the other ranks split the rest
  evenly (each a multiple of vpp);
- an explicit layout [pipeline_model_parallel_layout] in Megatron's syntax: pp * vpp stages split by '|' in
  schedule order, 'E' embedding, 't' transformer layer, 'm' MTP layer, 'L' loss, '(tt|)*30' repeats, commas
  cosmetic. DeepSeek-V3 at pp 8 x vpp 4 (61 layers + 1 MTP): 'Et|(tt|)*30mL'.
Global layer ids run chunk by chunk in schedule order: virtual stage 0 of pipeline ranks 0..pp-1, then virtual
stage 1, ... (Megatron's `get_transformer_layer_offset`); `chunk_layers` gives every chunk's count, `layer_offset`
its first id. Here the embedding is on the first chunk, the MTP layers and the loss on the last (the trainer
builds them there), so a layout must place E, m and L so.

Pure functions (no torch, no Megatron, no IO): the config validation runs them before any rank starts, the
planner uses them to place layers, and a refusal proposes a layout that `check` accepts.
"""
from __future__ import annotations

import re

from megatron_rl.config import ConfigError

_STAGE = re.compile(r"E?t*m*L?")


def parse_layout(text: str) -> list[str]:
    """'Et|(tt|)*2,mL' -> ['Et', 'tt', 'tt', 'mL'] (Megatron's unrolling: '(x)*n', then 'c*n'; commas dropped)."""
    s = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    bad = sorted(set(s) - set("EtmL|"))
    if bad:
        raise ConfigError(f"parallel.pipeline_layout={text!r}: unknown characters {bad} after unrolling; use E "
                          f"(embedding), t (transformer layer), m (MTP layer), L (loss), | (next stage), (..)*n")
    return s.split("|")


def format_layout(stages: list[str]) -> str:
    """The inverse of `parse_layout`, runs of equal stages written as '(tt|)*n' (the last stage kept apart)."""
    body, out, i = stages[:-1], [], 0
    while i < len(body):
        j = i
        while j < len(body) and body[j] == body[i]:
            j += 1
        out.append(f"({body[i]}|)*{j - i}" if j - i > 1 and body[i] else f"{body[i]}|" * (j - i))
        i = j
    return "".join(out) + stages[-1]


def check_layout(text: str, pp: int, vpp: int) -> list[str]:
    """The stages of a layout, refused (ConfigError naming the rule) unless it has pp * vpp stages, the embedding
    first, the loss last, MTP layers only in the last stage, and each stage in the order E t.. m.. L."""
    stages = parse_layout(text)
    key = f"parallel.pipeline_layout={text!r}"
    if len(stages) != pp * vpp:
        raise ConfigError(f"{key} has {len(stages)} stages; parallel.pp * vpp = {pp} * {vpp} = {pp * vpp} needs "
                          f"exactly that many ('|' separates stages)")
    for i, st in enumerate(stages):
        if not _STAGE.fullmatch(st):
            raise ConfigError(f"{key}: stage {i} {st!r} is not in the order E, t.., m.., L")
    joined = "".join(stages)
    if joined.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{key}: the embedding 'E' must appear once, at the start of the first stage")
    if joined.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{key}: the loss 'L' must appear once, at the end of the last stage")
    if joined.count("m") != stages[-1].count("m"):
        raise ConfigError(f"{key}: MTP layers 'm' go on the last stage (the trainer builds them there)")
    return stages


def chunk_layers(num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
                 layout: str | None = None) -> list[list[int]]:
    """Transformer layers of every chunk, [pipeline rank][virtual stage]; assumes `check` passed."""
    if layout is not None:
        stages = parse_layout(layout)
        return [[stages[v * pp + r].count("t") for v in range(vpp)] for r in range(pp)]
    if first is None and last is None:
        return [[num_layers // (pp * vpp)] * vpp for _ in range(pp)]
    middle_ranks = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    per_rank = [middle // middle_ranks if middle_ranks else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return [[n // vpp] * vpp for n in per_rank]


def layer_offset(counts: list[list[int]], pp_rank: int, vp_stage: int) -> int:
    """Global id of the first layer of chunk (pp_rank, vp_stage): the layers of the chunks before it in schedule
    order (every rank's earlier virtual stages, then this virtual stage of the ranks before)."""
    pp = len(counts)
    return sum(counts[r][v] for v in range(vp_stage + 1) for r in range(pp if v < vp_stage else pp_rank))


def check(num_layers: int, mtp_layers: int, pp: int, vpp: int = 1, first: int | None = None,
          last: int | None = None, layout: str | None = None) -> None:
    """Refuse (ConfigError with the reason and a layout that works) a split Megatron-Core cannot build."""
    why = _problem(num_layers, mtp_layers, pp, vpp, first, last, layout)
    if why:
        hint = propose(num_layers, mtp_layers, pp, vpp)
        raise ConfigError(f"{why}; e.g. set parallel.pipeline_layout: {hint!r} (first/last stage layer counts "
                          f"unset), or change parallel.pp/vpp")


def _problem(num_layers: int, mtp: int, pp: int, vpp: int, first, last, layout) -> str | None:
    if layout is not None:
        stages = check_layout(layout, pp, vpp)
        joined, key = "".join(stages), f"parallel.pipeline_layout={layout!r}"
        if joined.count("t") != num_layers:
            return f"{key} places {joined.count('t')} transformer layers 't'; model.num_layers={num_layers}"
        if joined.count("m") != mtp:
            return f"{key} places {joined.count('m')} MTP layers 'm'; model.mtp_num_layers={mtp}"
        return None
    if first is None and last is None:
        if num_layers % (pp * vpp):
            return f"model.num_layers={num_layers} is not divisible by parallel.pp*vpp = {pp * vpp}"
        return None
    return _first_last_problem(num_layers, pp, vpp, first, last)


def _first_last_problem(num_layers: int, pp: int, vpp: int, first, last) -> str | None:
    ends = [n for n in (first, last) if n is not None]
    middle, middle_ranks = num_layers - sum(ends), pp - len(ends)
    shown = f"parallel.first_stage_layers={first}, last_stage_layers={last}"
    if any(n % vpp for n in ends):
        return f"{shown}: each must be a multiple of parallel.vpp={vpp} (layers per virtual stage)"
    if middle < 0 or bool(middle) != bool(middle_ranks):
        return (f"{shown} leave {middle} of model.num_layers={num_layers} layers for the {middle_ranks} other "
                f"pipeline ranks")
    if middle_ranks and (middle % middle_ranks or (middle // middle_ranks) % vpp):
        return (f"{shown} leave {middle} layers, which do not split into {middle_ranks} other pipeline ranks x "
                f"vpp={vpp} equal chunks")
    return None


def balanced_chunks(n_slots: int, n_chunks: int) -> list[int]:
    """Slots per chunk as even as possible, the extra ones going to the inner chunks first (the first and last
    chunk also hold the embedding and the loss)."""
    base, extra = divmod(n_slots, n_chunks)
    sizes = [base] * n_chunks
    order = list(range(1, n_chunks - 1)) + [0, n_chunks - 1] if n_chunks > 2 else list(range(n_chunks))
    for i in order[:extra]:
        sizes[i] += 1
    return sizes


def propose(num_layers: int, mtp_layers: int, pp: int, vpp: int = 1) -> str:
    """A layout `check` accepts: layers and MTP layers (counted as slots) spread as evenly as possible over the
    pp * vpp chunks, the first and last chunk taking the shorter share, the MTP layers in the last chunk (for
    DeepSeek-V3 at pp 8 x vpp 4: Megatron's 'Et|(tt|)*30mL')."""
    n = pp * vpp
    sizes = balanced_chunks(num_layers + mtp_layers, n)
    if sizes[-1] >= mtp_layers:
        sizes[-1] -= mtp_layers
    else:
        sizes = balanced_chunks(num_layers, n)
    stages = ["t" * k for k in sizes]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return format_layout(stages)
