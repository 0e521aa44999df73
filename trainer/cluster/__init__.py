"""`python -m trainer.cluster`: a TF_CONFIG cluster of trainer.task processes
on this machine, in a private network namespace.

Modules: `main` (flags, the entry point), `launch` (starting, watching and
stopping the tasks), `private_network` (the loopback-only namespace); each
task's thread pools are its share of the cores (trainer/core_share.py).
"""
