"""RL algorithm pieces, pure PyTorch: policy losses (`LOSSES`) and advantage estimators (`ADVANTAGES`).

The trainer wires them into Megatron-Core; see `megatron_rl.rl.losses` for the normalisation contract that
keeps the loss invariant to micro-batch packing and data-parallel size.
"""
from megatron_rl.rl.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutput
from megatron_rl.rl.config import AdvantageConfig, LossConfig
from megatron_rl.rl.losses import (
    LOSSES,
    LossDefaults,
    LossInputs,
    LossOutput,
    kl_penalty,
    normaliser,
    register_loss,
    sample_token_counts,
)

__all__ = [
    "ADVANTAGES", "LOSSES", "AdvantageConfig", "AdvantageInputs", "AdvantageOutput", "LossConfig",
    "LossDefaults", "LossInputs", "LossOutput", "kl_penalty", "normaliser", "register_loss",
    "sample_token_counts",
]
