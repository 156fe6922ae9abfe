"""The pyfuse3 engine (`--engine pyfuse3`): FUSE requests served in Python on one trio thread, each
drive's reads on its own worker threads. The native engine (colifs.native, native/*.c) is the
default; both serve the same namespace, routing and mirror policy."""
