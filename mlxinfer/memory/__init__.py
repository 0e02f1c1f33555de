"""Memory: what this process and this machine use and can use."""

from .process import peak_rss_bytes

__all__ = ["peak_rss_bytes"]
