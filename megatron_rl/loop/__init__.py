"""The RL loop's parts: configs, task curriculum, episode runners, rollouts (sync/async), driver state.
The loop itself reads as prose in `megatron_rl/driver.py`."""
