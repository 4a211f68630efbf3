"""Damaged and hostile archives and images, made the way a broken disk, an editor or an attacker
makes them: each function rewrites the file at `path` in place (tests/test_hostile_files.py,
tests/test_sample_eval_faults.py)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

LOCAL, CENTRAL = b"PK\x03\x04", b"PK\x01\x02"
# offsets in a zip's local / central headers (APPNOTE 4.3.7 and 4.3.12)
FIELDS = {"flags": (6, 8), "method": (8, 10), "crc": (14, 16)}


def _patch_all(path: Path, field: str, value: bytes, *, local: bool = True, central: bool = True) -> None:
    """Write `value` into `field` of every entry's local and / or central header."""
    data = bytearray(path.read_bytes())
    local_at, central_at = FIELDS[field]
    for signature, offset, wanted in ((LOCAL, local_at, local), (CENTRAL, central_at, central)):
        start = 0
        while wanted and (found := data.find(signature, start)) >= 0:
            data[found + offset:found + offset + len(value)] = value
            start = found + 4
    path.write_bytes(bytes(data))


def encrypted(path: Path) -> None:
    """General-purpose flag bit 0: the entries say they are encrypted (zipfile: RuntimeError)."""
    _patch_all(path, "flags", struct.pack("<H", 0x0001))


def patched_data(path: Path) -> None:
    """Flag bit 5, compressed patched data (zipfile: NotImplementedError)."""
    _patch_all(path, "flags", struct.pack("<H", 0x0020))


def unknown_compression(path: Path) -> None:
    """Compression method 99 (AES), which zipfile does not read (NotImplementedError)."""
    _patch_all(path, "method", struct.pack("<H", 99))


def lzma_claimed(path: Path) -> None:
    """Compression method 14 (LZMA) over data that is not LZMA (lzma.LZMAError)."""
    _patch_all(path, "method", struct.pack("<H", 14))


def bad_checksum(path: Path) -> None:
    """Every CRC-32 wrong (zipfile: BadZipFile once a member is read to its end)."""
    _patch_all(path, "crc", b"\xde\xad\xbe\xef")


def bad_local_signature(path: Path) -> None:
    """The local headers' signatures broken (zipfile: BadZipFile 'Bad magic number')."""
    data = path.read_bytes().replace(LOCAL, b"PK\x07\x07")
    path.write_bytes(data)


def broken_deflate(path: Path) -> None:
    """Bytes of each deflated member's stream overwritten (zlib.error); the file must be deflated."""
    data = bytearray(path.read_bytes())
    start = 0
    while (found := data.find(LOCAL, start)) >= 0:
        name_len, extra_len = struct.unpack("<HH", data[found + 26:found + 30])
        body = found + 30 + name_len + extra_len
        data[body:body + 8] = b"\xff" * 8
        start = found + 4
    path.write_bytes(bytes(data))


def _each_npy(path: Path, edit) -> None:
    """Apply `edit` (bytes -> bytes) to a .npy file, or to every member of an .npz, which is
    written back with each member's own compression."""
    import zipfile

    if not zipfile.is_zipfile(path):
        path.write_bytes(edit(path.read_bytes()))
        return
    with zipfile.ZipFile(path) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in members:
            archive.writestr(info, edit(data), compress_type=info.compress_type)


def _cut_header(data: bytes) -> bytes:
    end = data.find(b"}", data.find(b"{'descr'"))
    return data[:end] + b"(" + data[end + 1:]


def _huge_shape(data: bytes) -> bytes:
    at = data.find(b"'shape': (") + len(b"'shape': (")
    end = data.find(b")", at)
    width = end - at
    return data[:at] + (b"9" * max(1, width - 1) + b",")[:width].ljust(width, b" ") + data[end:]


def npy_header_cut(path: Path) -> None:
    """A .npy header dict left open (numpy parses it as Python: tokenize.TokenError / SyntaxError)."""
    _each_npy(path, _cut_header)


def huge_shape(path: Path) -> None:
    """A .npy header asking for more memory than any machine has (the same header length)."""
    _each_npy(path, _huge_shape)


ZIP_DAMAGES = (encrypted, patched_data, unknown_compression, lzma_claimed, bad_checksum, bad_local_signature,
               npy_header_cut, huge_shape)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_bytes(width: int = 16, height: int = 16) -> bytes:
    """A small valid RGB PNG."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def png_huge_dimensions(path: Path, width: int = 40_000, height: int = 40_000) -> None:
    """A PNG whose header claims width x height pixels (a decompression bomb's first step)."""
    data = png_bytes()
    path.write_bytes(data[:8] + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + data[33:])


def png_text_bomb(path: Path) -> None:
    """A valid PNG with a zTXt chunk that inflates to 50 MB (past PIL's MAX_TEXT_CHUNK)."""
    data = png_bytes()
    bomb = _chunk(b"zTXt", b"comment\x00\x00" + zlib.compress(b"a" * 50_000_000, 9))
    path.write_bytes(data[:33] + bomb + data[33:])


def png_profile_bomb(path: Path) -> None:
    """A valid PNG with an iCCP colour profile that inflates to 50 MB."""
    data = png_bytes()
    bomb = _chunk(b"iCCP", b"icc\x00\x00" + zlib.compress(b"a" * 50_000_000, 9))
    path.write_bytes(data[:33] + bomb + data[33:])


def png_truncated(path: Path) -> None:
    path.write_bytes(png_bytes()[:60])


PNG_DAMAGES = (png_huge_dimensions, png_text_bomb, png_profile_bomb, png_truncated)
