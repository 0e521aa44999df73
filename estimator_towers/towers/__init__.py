"""One machine's towers: phases 1-3 of the tower build (see replicate.py).

Split the global batch into shards (sharding), build each tower on its
device with one set of variables, tables and batch-norm statistics for all
(variable_sharing, table_sharing, scoped_collections, optimizer_iterations,
global_batch_norm, moving_statistics, random_draws), then check what the
towers did (loss_reduction, tower_effects).
"""
