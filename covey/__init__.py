"""covey: an agent control plane whose kill switches are meant to be pulled."""

__version__ = "0.1.0"
