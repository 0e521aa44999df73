"""The values the library's string options take; no TensorFlow here.

`replicate_model_fn`'s `aggregation`, `random_ops` and `batch_norm` and
`make_run_config`'s `mixed_precision` each take one of these names. They
live apart from the modules that implement them so that a command line can
offer them as flag choices, and refuse a bad flag, before it loads
TensorFlow (trainer.options).
"""

AGGREGATIONS = ('global_loss', 'round_robin', 'all_reduce')
RANDOM_OPS = ('per_tower', 'one_device')
BATCH_NORMS = ('global', 'per_tower')
MIXED_PRECISIONS = ('float16', 'bfloat16')
