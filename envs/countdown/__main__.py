"""python -m megatron_rl.envs.countdown: regenerate the shipped task files."""
from megatron_rl.envs.countdown.env import main

main()
