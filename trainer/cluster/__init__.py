"""`python -m trainer.cluster`: a TF_CONFIG cluster of trainer.task processes
on this machine, in a private network namespace.

Modules: `main` (flags, the entry point), `launch` (starting, watching and
stopping the tasks), `private_network` (the loopback-only namespace),
`core_share` (each task's thread pools: its share of the machine's cores).
"""
