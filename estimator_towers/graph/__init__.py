"""Graph bookkeeping every phase shares: which tower or phase made an op
(op_ledger), class patches confined to the build's graph and thread
(patching), the graph functions an op runs (functions), the axes a
reduction reduces (reductions), and the tensor a static shape constant was
folded from (folded_shapes).
"""
