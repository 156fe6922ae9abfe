"""User-facing errors: one line on stderr and a specific exit code, never a traceback."""

from __future__ import annotations

# Exit codes (documented in README.md). 2 is argparse's own code for a bad command line.
EXIT_USAGE = 2
EXIT_NOT_MOUNTED = 3
EXIT_BUSY = 6  # `colifs umount`: a process still has a file of the mount open or mapped
EXIT_NOT_RELOADED = 7  # `colifs reload` (or `stage`'s): the mount did not reload; it serves as before
EXIT_MOUNT_FAILED = 32  # same meaning as mount(8)'s 32: "mount failure"


class QuietError(Exception):
    """An error whose message is all the user needs (s3ql's QuietError)."""

    exit_code = 1

    def with_code(self, code: int) -> QuietError:
        """The same error with a more specific exit code."""
        self.exit_code = code
        return self


class UsageError(QuietError):
    """Bad arguments or bad input given by the user."""

    exit_code = EXIT_USAGE


class MountError(QuietError):
    """The filesystem could not be mounted; nothing is left mounted."""

    exit_code = EXIT_MOUNT_FAILED


class NotReloadedError(QuietError):
    """A mount did not reload (no answer in time, not allowed, failed): it serves as before."""

    exit_code = EXIT_NOT_RELOADED


class NotMountedError(QuietError):
    """The path given is not a running colifs mount."""

    exit_code = EXIT_NOT_MOUNTED


class BusyError(QuietError):
    """The mount is in use; unmounting it would pull files from under running processes."""

    exit_code = EXIT_BUSY
