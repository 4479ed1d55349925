"""The data node server: append, fetch, seal, sync, trim, delete (docs/datanode.md)."""

from sbpstream.datanode.config import DataNodeConfig
from sbpstream.datanode.node import DataNodeServer, run_datanode

__all__ = ["DataNodeConfig", "DataNodeServer", "run_datanode"]
