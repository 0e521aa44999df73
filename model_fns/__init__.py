"""Ready-made model_fns, each written for ONE device and configured by params.

Wrap any of them with `trainer.replicate_model_fn` to use every device.
"""
