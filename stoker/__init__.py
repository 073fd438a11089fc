"""stoker: keeps inference accelerators fed."""

__version__ = "0.1.0"
