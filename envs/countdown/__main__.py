"""python -m envs.countdown: regenerate the shipped task files."""
from envs.countdown.env import main

main()
