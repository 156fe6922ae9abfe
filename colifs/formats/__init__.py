"""Model file formats colifs routes by: how to read a file's header into a Layout.

Each format reads only the header (never tensor data) and returns the file size, the header bytes
a mirror copy must match byte for byte, and the Layout. A file is of a format by its suffix, or,
without a known suffix (Ollama's blobs, renamed files), by its first bytes. Files of other kinds
are served as plain bytes from the primary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from colifs.formats.gguf import gguf_tensor_spans, read_gguf_header
from colifs.formats.layout import ExpertConfig, Layout, LayoutError
from colifs.formats.safetensors import header_length, parse_header, tensor_spans

GGUF_MAGIC = b"GGUF"
MAX_SAFETENSORS_HEADER = 100 << 20  # what the safetensors library itself accepts

Header = tuple[int, bytes, Layout]  # file size, header bytes, layout


def _pread_all(fd: int, n: int, off: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), off + len(out))
        if not chunk:
            break
        out += chunk
    return out


def read_safetensors(fd: int, size: int, experts: ExpertConfig | None) -> tuple[bytes, Layout]:
    """The 8-byte length + JSON, and its layout (`experts`: what config.json says)."""
    n = header_length(_pread_all(fd, 8, 0), size)
    header = _pread_all(fd, 8 + n, 0)
    if len(header) != 8 + n:
        raise LayoutError(f"header cut short: {len(header) - 8} of {n} bytes read")
    return header, parse_header(header, size, experts)


def read_gguf(fd: int, size: int, experts: ExpertConfig | None) -> tuple[bytes, Layout]:
    """Everything up to the aligned start of the data section, and its layout. A GGUF file states
    its expert count in its own metadata, which is what counts (`experts` is not used)."""
    layout, header = read_gguf_header(lambda off, n: _pread_all(fd, n, off), size)
    return header, layout


@dataclass(frozen=True)
class Format:
    name: str
    suffix: str
    reader: Callable[[int, int, ExpertConfig | None], tuple[bytes, Layout]]
    spans: Callable[[bytes, int], list[tuple[int, int, str]]]  # header → (start, end, tensor name)

    def read(self, path: str, experts: ExpertConfig | None = None) -> Header:
        """(size, header bytes, layout) of the file at `path`, its fused experts cut as its config
        says (`experts`, colifs.formats.moe); LayoutError or OSError if bad."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            header, layout = self.reader(fd, size, experts)
            return size, header, layout
        finally:
            os.close(fd)

    def looks_like(self, head: bytes, size: int) -> bool:
        """Whether a file of `size` bytes starting with `head` (9 bytes or fewer) is of this format:
        the GGUF magic, or a safetensors header length that fits the file followed by a JSON
        object."""
        if self.name == "gguf":
            return head.startswith(GGUF_MAGIC)
        if len(head) < 9:
            return False
        n = int.from_bytes(head[:8], "little")
        return 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER) and head[8:9] == b"{"


FORMATS = (
    Format("safetensors", ".safetensors", read_safetensors, tensor_spans),
    Format("gguf", ".gguf", read_gguf, gguf_tensor_spans),
)


def tensor_at(path: str, offset: int) -> str | None:
    """The name of the tensor holding byte `offset` of a model file (reads its header only)."""
    fmt = format_for(path)
    if fmt is None:
        return None
    size, header, _ = fmt.read(path)
    for start, end, name in fmt.spans(header, size):
        if start <= offset < end:
            return name
    return None


def format_of(relpath: str) -> Format | None:
    """The format a file is routed by, from its name; None when the name says none."""
    for fmt in FORMATS:
        if relpath.endswith(fmt.suffix):
            return fmt
    return None


def format_for(path: str) -> Format | None:
    """The format of the file at `path`: by its name, else by its first bytes (one read of 9
    bytes); None for plain files and files that cannot be read."""
    fmt = format_of(path)
    if fmt is not None:
        return fmt
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            head, size = os.pread(fd, 9, 0), os.fstat(fd).st_size
        finally:
            os.close(fd)
    except OSError:
        return None
    return next((f for f in FORMATS if f.looks_like(head, size)), None)
