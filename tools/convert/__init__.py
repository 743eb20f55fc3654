"""`megatron-rl convert`: the operator CLI (cli.py) over the product's conversion library, `megatron_rl.convert`."""
