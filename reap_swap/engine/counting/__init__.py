"""Router statistics counted on the device: per-layer routed selections and gate mass.

Not residency: the counters count whatever the router picks, wherever the experts live (they run
unchanged in accounting mode and on a stock-sized pool alike).
"""
