"""lantern-runtime: visual autoregressive generation with LANTERN++ speculative decoding."""

__version__ = "0.1.0"
