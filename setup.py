"""The native engine (colifs._native): a C extension built against libfuse3 by `pip install`.

Everything else is in pyproject.toml. The flags come from pkg-config, as pyfuse3's own build does.
What the build needs is checked first, so a missing piece is one line naming the package to install.
"""

import os
import shlex
import shutil
import subprocess
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

LIBFUSE = "3.12"  # FUSE_USE_VERSION 312 (native/engine.h): fuse_loop_cfg_* and fuse_session_loop_mt
DEBIAN = "Debian/Ubuntu: apt-get install"


def need(what: str, package: str) -> SystemExit:
    return SystemExit(f"colifs: building the native engine needs {what} ({DEBIAN} {package})")


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise need(
            f"libfuse3's headers ({LIBFUSE} or newer) and pkg-config", "libfuse3-dev pkg-config"
        ) from e
    return shlex.split(out.stdout)


def check_toolchain() -> None:
    """A C compiler, Python's headers and libfuse >= LIBFUSE, each named when missing."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        raise need(f"a C compiler ({cc[0] if cc else 'cc'} not found)", "gcc")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        raise need("Python's headers (Python.h)", "python3-dev")
    version = pkg_config("--modversion")
    if subprocess.run(["pkg-config", f"--atleast-version={LIBFUSE}", "fuse3"]).returncode != 0:
        raise need(f"libfuse {LIBFUSE} or newer (found {' '.join(version)})", "libfuse3-dev")


class BuildNative(build_ext):
    """Checks the toolchain and takes libfuse's flags when the engine is compiled (not for an sdist)."""

    def build_extensions(self) -> None:
        check_toolchain()
        for ext in self.extensions:
            ext.extra_compile_args = [*pkg_config("--cflags"), *ext.extra_compile_args]
            ext.extra_link_args = pkg_config("--libs")
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildNative},
    ext_modules=[
        Extension(
            "colifs._native",
            sources=[f"native/{n}.c" for n in ("module", "fs", "drives", "fill", "view", "passthrough")],
            depends=["native/engine.h"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror=implicit"],
        )
    ],
)
