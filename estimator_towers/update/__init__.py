"""The one update: phase 4 of the tower build (see replicate.py).

The towers' optimizer calls are routed (gradient_routing) and made once, on
the global-batch loss (one_update), with float16's loss scale
(loss_scaling); the step's writes wait for its reads (write_order), and
micro-batches run as towers one after another (micro_batches). A loss the
graph walk cannot follow is compared with one device's before the first
step (first_step_check).
"""
