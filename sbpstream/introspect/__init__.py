"""Introspection: INFO, STATS, CONNECTIONS and WHOAMI (project opcodes, after Throttr's), the PM's
cluster view, their JSON on the admin HTTP port, and what the CLI and the web console read.

- :mod:`.rates`: per-minute figures from periodic snapshots of monotonic counters (no I/O);
- :mod:`.figures`: per-process figures (opcodes, connections, a data node's streams) and the wire
  handlers of the four opcodes (:class:`Introspector`);
- :mod:`.cluster`: the PM's view of the cluster (nodes, streams with the data nodes' figures,
  under-replicated ranges, live clients, a stream's latest records);
- :mod:`.http`: the ``/v1/...`` JSON routes and the console's static files;
- :mod:`.wire`: the client side, for the CLI.

The counters themselves live where the traffic is (``net.server`` per opcode and connection,
the data node's append and fetch handlers per stream) and cost one integer add each.
"""
