r"""The package's version, on the bottom floor so that any module may stamp it."""

__version__ = "0.1.0"
