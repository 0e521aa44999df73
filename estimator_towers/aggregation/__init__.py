"""Aggregation strategies: where the variables live and how the towers'
gradients meet (strategies), with all_reduce's copy per tower device
(replicas) and its gradient path through them (replica_path). See
docs/aggregation.md.
"""
