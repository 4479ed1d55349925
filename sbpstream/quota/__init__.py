"""Quotas and throttling (issue 22): quota records, Throttr-style TTL counters, enforcement.

No I/O here: :mod:`.model` is what a quota is and which values are refused, :mod:`.counters`
the rate windows (one record per key and window, expiring with its TTL), :mod:`.enforcer` how a
data node charges one request against them and how long the client must hold off.
"""
