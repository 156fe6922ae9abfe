"""The native engine (colifs._native): a C extension built against libfuse3 by `pip install`.

Everything else is in pyproject.toml. The flags come from pkg-config, as pyfuse3's own build does.
"""

import shlex
import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            "colifs: building the native engine needs libfuse3's headers and pkg-config "
            "(Debian/Ubuntu: apt-get install libfuse3-dev pkg-config)"
        ) from e
    return shlex.split(out.stdout)


setup(
    ext_modules=[
        Extension(
            "colifs._native",
            sources=["native/module.c", "native/fs.c", "native/drives.c", "native/prefetch.c"],
            depends=["native/engine.h"],
            extra_compile_args=[*pkg_config("--cflags"), "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror=implicit"],
            extra_link_args=pkg_config("--libs"),
        )
    ]
)
