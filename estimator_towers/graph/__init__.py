"""Graph bookkeeping every phase shares: which tower or phase made an op
(op_ledger), class patches confined to the build's graph and thread
(patching), and the graph functions an op runs (functions).
"""
