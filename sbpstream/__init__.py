"""sbpstream: distributed stream storage speaking SBP."""

__version__ = "0.1.0"
