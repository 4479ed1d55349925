"""Operator tools beside the CLI (not the SDK): a replica check and a load generator."""
