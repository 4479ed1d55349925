"""Placement Manager: metadata (sqlite | etcd), placement, liveness, the PM server."""
