"""Checkpoint conversion HF <-> Megatron-Core `dist_checkpointing` (torch_dist), and resharding: a library of the
product (`model.init` and the end-of-run export use it: `source.py`, `commands/export.py`); the operator CLI
on top is `tools/convert/cli.py`.

    megatron-rl convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--verify]
    megatron-rl convert mcore-to-hf --ckpt DIR --out DIR [--hf-config DIR_or_ARCH] [--verify]
    megatron-rl convert reshard --ckpt A --out B --tp N --pp N [--ep N] [--verify]

Names. Every Megatron tensor has a *canonical name*: its local-spec parameter name with the global layer
index and the global expert index (`decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`) and
its unsharded shape. `arch/` maps canonical names onto HF tensors (one file per architecture);
`layout.py` maps canonical names onto dist_checkpointing keys and onto the shard a rank holds, reading
both from Megatron's own `sharded_state_dict()`, so no TP/PP/EP slicing rule is written here.
dist_checkpointing checkpoints are layout-independent: any layout loads them (`reshard` rewrites one
at another layout and checks that it loads there).
"""
