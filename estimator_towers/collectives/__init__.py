"""Collectives across devices: all_reduce's sums (cross_device) and the
group and instance keys of every collective (collective_keys).
"""
