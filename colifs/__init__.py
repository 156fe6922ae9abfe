"""colifs: a read-only FUSE filesystem that serves each tensor from its hash-chosen drive."""

__version__ = "0.1.0"
