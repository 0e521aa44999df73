"""Aggregation strategies: where the variables live and how the towers'
gradients meet (strategies), with all_reduce's copy per tower device
(replicas). See docs/aggregation.md.
"""
