# megatron_rl first: its import defers Megatron's torch.compile decorations (megatron_rl/compat/deferred_compile.py)
# in the test processes and the tests/mp rank scripts too
import megatron_rl  # noqa: F401
