"""A checkpoint folder on disk: written aside and renamed into place, with a manifest of checksums.

[Note: atomic checkpoints]
``torch.distributed.checkpoint`` has every rank write its own files, then
rank 0 writes ``.metadata``. zero_fx writes all of that into
``<path>.incomplete``; once every rank has finished, rank 0 records each
file's size and CRC-32 in ``zero_fx.json`` (the manifest, written last) and
renames the folder to ``<path>`` (an earlier checkpoint there is moved aside
first and deleted after). A crash at any point leaves either the previous
checkpoint or a folder without a manifest, which ``read_manifest`` refuses.
Loading checks every file against the manifest, spread over the ranks, so a
truncated or corrupted file is an error that names it, not a wrong model.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Callable

MANIFEST = "zero_fx.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    """The checkpoint cannot be loaded: incomplete, truncated, corrupted, or for another model."""


def staging_path(path: str) -> str:
    return f"{os.fspath(path).rstrip(os.sep)}.incomplete"


def clear_staging(path: str) -> str:
    """Rank 0: remove what an interrupted save left; return the folder to write into."""
    staging = staging_path(path)
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish(path: str, manifest: dict) -> None:
    """Rank 0, after every rank has written: record checksums, then move the folder into place."""
    staging = staging_path(path)
    manifest = dict(manifest, format=FORMAT, files={
        name: {"bytes": os.path.getsize(os.path.join(staging, name)),
               "crc32": _crc32(os.path.join(staging, name))}
        for name in sorted(os.listdir(staging))})
    partial = os.path.join(staging, MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(staging, MANIFEST))
    replaced = f"{os.fspath(path).rstrip(os.sep)}.replaced"
    shutil.rmtree(replaced, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, replaced)
    os.rename(staging, path)
    shutil.rmtree(replaced, ignore_errors=True)


def read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        if not os.path.isdir(path):
            hint = (f"; {staging_path(path)} exists: a save that did not finish"
                    if os.path.isdir(staging_path(path)) else "")
            raise CheckpointError(f"no checkpoint at {path}{hint}")
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a zero_fx checkpoint, or the "
                              "save that wrote it did not finish")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except ValueError as err:
        raise CheckpointError(f"{manifest_path} is corrupted: {err}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is in checkpoint format {manifest.get('format')}; this "
                              f"zero_fx reads format {FORMAT}")
    return manifest


def check_files(path: str, manifest: dict, mine: Callable[[int], bool]) -> list[str]:
    """What is wrong with the files whose index ``mine`` accepts (the caller's share)."""
    problems = []
    for index, (name, expected) in enumerate(sorted(manifest["files"].items())):
        if not mine(index):
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) != expected["bytes"]:
            problems.append(f"{name} is truncated or overwritten: {os.path.getsize(file):,} bytes, "
                            f"{expected['bytes']:,} written")
        elif _crc32(file) != expected["crc32"]:
            problems.append(f"{name} is corrupted: its CRC-32 differs from the one written")
    return problems


def raise_if_damaged(path: str, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(sorted(problems)))


def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc
