"""Graph bookkeeping every phase shares: which tower or phase made an op
(op_ledger) and class patches confined to the build's graph and thread
(patching).
"""
