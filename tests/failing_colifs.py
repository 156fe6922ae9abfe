"""`colifs` whose namespace handlers fail on demand, to test the error boundary of both engines.

    python -m tests.failing_colifs mount ...      (COLIFS_TEST_FAULTS=FILE in the environment)

Each call of a patched `Namespace` method reads FILE: when it names the method, the call raises
a RuntimeError (a bug, as far as colifs can tell). Test tool only.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from colifs.cli import main
from colifs.namespace import Namespace

FAULTS_ENV = "COLIFS_TEST_FAULTS"
PATCHED = ("lookup", "attr", "children", "statfs", "snapshot", "xattr", "xattr_names")


def failing(name: str, fn: Callable[..., Any], faults: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with open(faults) as f:
                active = f.read().split()
        except OSError:
            active = []
        if name in active:
            raise RuntimeError(f"injected fault in Namespace.{name}")
        return fn(*args, **kwargs)

    return wrapper


if __name__ == "__main__":
    for method in PATCHED:
        setattr(Namespace, method, failing(method, getattr(Namespace, method), os.environ[FAULTS_ENV]))
    raise SystemExit(main())
