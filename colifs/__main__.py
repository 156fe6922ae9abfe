"""`python -m colifs` runs the CLI (the test-suite and the benchmarks start daemons this way)."""

from colifs.cli import main

raise SystemExit(main())
