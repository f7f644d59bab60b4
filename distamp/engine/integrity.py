"""A checkpoint's files as they were written: each file's size and CRC-32, recorded at save time
in the step directory's listing (``files.json``) and verified before a load applies anything.

Why: DCP reads a shard straight into the model's and optimizer's own tensors, so a shard that
lost its last bytes (a copy cut short) would be found only half-way through applying it, with the
model already partly overwritten; and a ``torch.save`` file that still unpickles can hold damaged
bytes (``torch.load`` does not check the zip records' CRCs). With every file's size and CRC-32
checked first, both are refused while nothing has changed, naming the file.

CRC-32 detects damage (truncation, flipped or zeroed blocks), not deliberate edits made to fool
it: a file changed by hand on purpose is re-recorded with :func:`record_listing`. zlib's CRC-32
runs at ~4.7 GB/s on one core (a 256 MB buffer; SHA-256 1.4 GB/s), and the work is spread over
the ranks (:func:`share`): the save reads the checkpoint back once, which also proves that what
was written can be read, and the load reads it once before DCP does.

Checkpoints written before the listing existed have none: they load as before (each file must
unpickle and have the expected structure).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "LISTING",
    "file_digest",
    "listed_files",
    "read_listing",
    "record_listing",
    "share",
    "verify_files",
    "write_listing",
]

LISTING = "files.json"
_FORMAT = 1
_CHUNK = 4 << 20  # bytes read at a time: the digest's memory stays flat whatever the file size


def file_digest(path: Path) -> tuple[int, int]:
    """``(size, crc32)`` of the file at ``path``, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def listed_files(step_dir: Path) -> list[str]:
    """Every file under ``step_dir`` (paths relative to it, ``/``-separated), the listing
    itself excepted, sorted."""
    return sorted(
        p.relative_to(step_dir).as_posix()
        for p in step_dir.rglob("*")
        if p.is_file() and p.relative_to(step_dir).as_posix() != LISTING
    )


def share(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The part of ``names`` that ``rank`` digests: each name goes to one rank, chosen by a
    CRC of the name (the same on every rank, whatever order each lists the files in)."""
    return [n for n in names if zlib.crc32(n.encode()) % world == rank]


def write_listing(step_dir: Path, digests: Mapping[str, tuple[int, int]]) -> None:
    """Write ``step_dir/files.json`` from ``digests`` (name -> (size, crc32)), fsynced."""
    files = {name: {"size": size, "crc32": crc} for name, (size, crc) in sorted(digests.items())}
    with open(step_dir / LISTING, "w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())


def record_listing(step_dir: str | os.PathLike[str]) -> Path:
    """Record the sizes and CRCs of the files of ``step_dir`` as they are now (one process).

    For a checkpoint file changed on purpose (a field edited by hand): without this, the load
    refuses it as damaged. Returns the listing's path.
    """
    path = Path(step_dir)
    write_listing(path, {name: file_digest(path / name) for name in listed_files(path)})
    return path / LISTING


def read_listing(step_dir: Path) -> dict[str, tuple[int, int]] | None:
    """The listing of ``step_dir`` (name -> (size, crc32)), or ``None`` when it has none (a
    checkpoint written before listings existed).

    Raises:
        ValueError: the listing is unreadable or malformed (the message says how).
    """
    path = step_dir / LISTING
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(files, dict):
        raise ValueError(f"expected {{'format': {_FORMAT}, 'files': {{...}}}}, got {data!r:.120}")
    out = {}
    for name, entry in files.items():
        ok = isinstance(entry, dict) and all(
            isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] >= 0
            for k in ("size", "crc32")
        )
        parts = Path(name).parts
        if not ok or not parts or ".." in parts or Path(name).is_absolute():
            raise ValueError(f"entry {name!r}: expected a relative path and a size and crc32")
        out[name] = (entry["size"], entry["crc32"])
    return out


def verify_files(
    step_dir: Path, listing: Mapping[str, tuple[int, int]], *, rank: int, world: int
) -> tuple[Path, str] | None:
    """The first listed file of ``step_dir`` that is missing, of another size, or (among this
    rank's :func:`share`) of another CRC, with why; ``None`` when all are as listed.

    Every rank checks every size (a ``stat`` each) and its share of the CRCs, so the ranks
    together read the checkpoint once.
    """
    for name, (size, _) in sorted(listing.items()):
        path = step_dir / name
        try:
            found = path.stat().st_size
        except OSError as exc:
            return path, f"listed in {LISTING} but unreadable: {exc.strerror or exc}"
        if found != size:
            return path, f"{found} bytes, {size} when it was saved (truncated or damaged)"
    for name in share(sorted(listing), rank, world):
        path = step_dir / name
        try:
            _, crc = file_digest(path)
        except OSError as exc:
            return path, f"unreadable: {exc.strerror or exc}"
        if crc != listing[name][1]:
            return path, (
                f"CRC-32 {crc:08x}, {listing[name][1]:08x} when it was saved (damaged, or "
                f"changed after the save; if that was deliberate, re-record the checkpoint with "
                f"distamp.engine.integrity.record_listing({str(step_dir)!r}))"
            )
    return None
