"""`python -m colifs` runs the CLI (the test-suite and the daemon re-exec use this)."""

from colifs.cli import main

raise SystemExit(main())
