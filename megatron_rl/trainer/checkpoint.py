"""Exact, reshardable checkpoints of the policy trainer with `megatron.core.dist_checkpointing`.

One checkpoint directory holds the model (every virtual-pipeline chunk), the optimizer state (the
DistributedOptimizer's as `fully_reshardable`, so it loads under another TP/PP/DP layout), the frozen
reference model when there is one, the PPO critic when there is one (its model, value head and optimizer
under `critic.`, its scheduler and step in the common part), and in the common part the LR scheduler, the
step counter and rank 0's torch RNG state. A LoRA policy (`policy.lora`) saves its adapters only (model and
optimizer): the frozen base, and the KL reference (the base itself), are rebuilt from model.init on resume.
The save runs with `megatron_rl.compat.sync_save` installed: no spawned multiprocessing manager (which re-imported
the caller's main module and needed an `if __name__ == "__main__":` guard).

Without TE/Apex the torch Adam path of Megatron's optimizers loads one `step` tensor SHARED by every
parameter, so each optimizer step then increments it once per parameter and the bias correction goes wrong
(silent divergence after resume). `load_checkpoint` un-shares it, and creates Adam's state before loading
(without it building the load template fails: no `step` to read). Adam creates its state lazily at the first
update, and Megatron's torch-Adam `state_dict` asserts exactly one distinct `step` among the states, so an
optimizer that has not updated yet (e.g. every RL step so far skipped: all groups filtered) cannot be saved
either: both save and load first create the state exactly as Adam's lazy initialisation would (zero moments,
step 0), which changes nothing about the next update.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(chunks, prefix: str = "") -> dict:
    """{model0: sharded dict, model1: ...} of raw GPTModel chunks (keys of the tensors are global)."""
    return {f"{prefix}model{i}": m.sharded_state_dict(prefix=prefix) for i, m in enumerate(chunks)}


def _adapters_only(state: dict) -> dict:
    """A chunk's sharded dict reduced to its LoRA adapters (trainer/lora.py)."""
    from megatron_rl.trainer.lora import is_adapter

    return {k: v for k, v in state.items() if is_adapter(k)}


def _state(policy, reference, is_loading: bool, critic=None) -> dict:
    model = _model_state([c.module for c in policy.chunks])
    if getattr(policy, "lora", None) is not None:  # the frozen base (and the reference: it is the base) comes
        model = {k: _adapters_only(v) for k, v in model.items()}  # from model.init again on resume
        reference = None
    state = {**model, "optimizer": policy.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                        metadata=SHARDING)}
    if reference is not None:
        state.update(_model_state(reference.chunks, prefix="reference."))
    if critic is not None:
        cm = _model_state([c.module for c in critic.model.chunks], prefix="critic.")
        state["critic"] = {**cm, "optimizer": critic.model.optimizer.sharded_state_dict(
            cm, is_loading=is_loading, metadata=SHARDING)}
    return state


def save_checkpoint(policy, path: str | Path, reference=None, extra: dict | None = None, critic=None) -> None:
    """Save model, optimizer, scheduler, step (and `extra`, plain data from rank 0) to directory `path`; with
    `critic` (a `trainer.critic.ValueModel`) its model, optimizer, scheduler and step too. Collective over the
    policy's world (`policy.ctx.world`), whose first rank creates the folder."""
    from megatron.core import dist_checkpointing

    from megatron_rl.compat import sync_save

    sync_save.install()
    path = Path(path)
    world = policy.ctx.world
    if torch.distributed.get_rank(world) == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier(group=world)
    _prime_adam_state(policy.optimizer)
    if critic is not None:
        _prime_adam_state(critic.model.optimizer)
    state = _state(policy, reference, is_loading=False, critic=critic)
    state["trainer"] = {"step": policy.step_count, "scheduler": policy.scheduler.state_dict(),
                        "rng": torch.get_rng_state(), "extra": extra or {}}
    if critic is not None:
        state["critic"]["trainer"] = {"step": critic.model.step_count,
                                      "scheduler": critic.model.scheduler.state_dict()}
    dist_checkpointing.save(state, str(path))


def load_checkpoint(policy, path: str | Path, reference=None, critic=None) -> dict:
    """Load a checkpoint saved under any layout into `policy` (and `reference`, `critic`); returns `extra`."""
    from megatron.core import dist_checkpointing

    if reference is not None and not has_reference(path) and getattr(policy, "lora", None) is None:
        raise ValueError(f"checkpoint {path} holds no KL reference model (saved with rl.trainer.reference=false or "
                         "before references were saved), but this run needs one; resume with the reference "
                         "setting it was saved with, or start the run over")
    if critic is not None and not has_prefix(path, "critic."):
        raise ValueError(f"checkpoint {path} holds no critic (value model), but this run trains one (advantage "
                         "gae); resume with the advantage estimator it was saved with, or start the run over")
    if getattr(policy, "lora", None) is not None:
        _check_adapters(policy, path)
    _prime_adam_state(policy.optimizer)
    if critic is not None:
        _prime_adam_state(critic.model.optimizer)
    state = dist_checkpointing.load(_state(policy, reference, is_loading=True, critic=critic), str(path))
    lora = getattr(policy, "lora", None) is not None
    for i, chunk in enumerate(policy.chunks):
        _load_model(chunk.module, state[f"model{i}"], lora)
    if reference is not None and not lora:
        for i, m in enumerate(reference.chunks):
            m.load_state_dict(_strip(state[f"reference.model{i}"], "reference."))
    _load_optimizer(policy.optimizer, state["optimizer"])
    _unshare_adam_step(policy.optimizer)
    trainer = state["trainer"]
    policy.scheduler.load_state_dict(trainer["scheduler"])
    policy.step_count = int(trainer["step"])
    torch.set_rng_state(trainer["rng"])
    if critic is not None:
        _load_critic(critic, state["critic"])
    return trainer.get("extra", {})


def _check_adapters(policy, path) -> None:
    """A LoRA policy's checkpoint must hold every adapter of the policy (same lora.targets, saved with lora)."""
    from megatron.core import dist_checkpointing

    want = {sh.key for i, c in enumerate(policy.chunks)
            for sh in _adapters_only(c.module.sharded_state_dict()).values()}
    missing = sorted(want - set(dist_checkpointing.load_tensors_metadata(str(path))))
    if missing:
        raise ValueError(f"checkpoint {path} lacks LoRA adapters {missing[:4]}: it was saved without lora or with "
                         "other lora.targets; resume with the run's lora settings or start the run over")


def _load_model(module, state: dict, adapters_only: bool) -> None:
    """Load a chunk; a LoRA policy's checkpoint holds its adapters only, and must hold every one of them."""
    if not adapters_only:
        module.load_state_dict(state)
        return
    missing = module.load_state_dict(state, strict=False).missing_keys
    from megatron_rl.trainer.lora import is_adapter

    if not state or any(is_adapter(k) for k in missing):
        raise ValueError(f"checkpoint lacks LoRA adapters {[k for k in missing if is_adapter(k)][:4] or 'all'}: "
                         "it was saved without lora or with other lora.targets; resume with the run's lora "
                         "settings or start the run over")


def _load_critic(critic, state: dict) -> None:
    for i, chunk in enumerate(critic.model.chunks):
        chunk.module.load_state_dict(_strip(state[f"critic.model{i}"], "critic."))
    _load_optimizer(critic.model.optimizer, state["optimizer"])
    _unshare_adam_step(critic.model.optimizer)
    critic.model.scheduler.load_state_dict(state["trainer"]["scheduler"])
    critic.model.step_count = int(state["trainer"]["step"])


def has_reference(path: str | Path) -> bool:
    """The checkpoint at `path` holds a frozen reference model (tensors saved under `reference.`)."""
    return has_prefix(path, "reference.")


def has_prefix(path: str | Path, prefix: str) -> bool:
    """The checkpoint at `path` holds tensors whose keys start with `prefix` (reference., critic.)."""
    from megatron.core import dist_checkpointing

    return any(k.startswith(prefix) for k in dist_checkpointing.load_tensors_metadata(str(path)))


def _load_optimizer(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, with the DistributedOptimizer copying only the states the checkpoint has:
    without TE/Apex its fully-reshardable load skips Adam's `step` in the source but not in the destination
    (KeyError: 'step'); `step` itself comes from the param groups."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    patched = [s for s in subs if hasattr(s, "model_param_group_index_map")]
    for sub in patched:
        sub._set_main_param_and_optimizer_states = functools.partial(_set_present_states, sub)
    try:
        optimizer.load_state_dict(state)
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states


def _set_present_states(opt, model_param, tensors: dict) -> None:
    """Copy `tensors` ({param, exp_avg, exp_avg_sq}, this rank's shard) into the main param and Adam state."""
    group, order = opt.model_param_group_index_map[model_param]
    main = opt.optimizer.param_groups[group]["params"][order]
    dst = {"param": main, **opt.optimizer.state[main]}
    for key, value in tensors.items():
        dst[key].copy_(value)


def _strip(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron (chained) optimizer."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s.optimizer for s in subs]


def _prime_adam_state(optimizer) -> None:
    """Create the Adam state of every parameter that has none yet, exactly as torch Adam's lazy initialisation
    does (step 0, zero moments): the next update is unchanged, and save/load templates find the state."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if inner.state[p]:
                    continue
                st = {"step": torch.tensor(0.0, dtype=torch.float32),
                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p] = st


def _unshare_adam_step(optimizer) -> None:
    """Give every parameter its own `step` tensor (loading shares one; torch Adam increments it in place)."""
    for inner in _inner_optimizers(optimizer):
        for st in inner.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].detach().clone()
