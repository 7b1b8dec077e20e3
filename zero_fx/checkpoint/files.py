"""A checkpoint folder on disk: written aside and renamed into place, with a manifest of checksums.

[Note: atomic checkpoints]
``torch.distributed.checkpoint`` has every rank write its own files, then
rank 0 writes ``.metadata``. zero_fx writes all of that into
``<path>.incomplete``; once every rank has finished, rank 0 records each
file's size and CRC-32 in ``zero_fx.json`` (the manifest, written last) and
renames the folder to ``<path>`` (an earlier checkpoint there is moved to
``<path>.replaced`` first and deleted after). A crash (a rank killed) at any
point leaves a loadable checkpoint, the previous one or the new one:

- before the manifest: ``<path>`` is the previous checkpoint, and the staged
  folder has no manifest, so ``read_manifest`` refuses it if named;
- between the two renames: ``<path>`` is gone and ``<path>.replaced`` holds
  the previous checkpoint. ``readable_path`` loads it from there, and the next
  save moves it back first (``prepare_save``);
- after the second rename: ``<path>`` is the new checkpoint; the old one left
  in ``<path>.replaced`` is deleted by the next save.

A save that fails (a full disk) leaves ``<path>`` as it was. Loading checks
every file against the manifest, spread over the ranks, so a truncated or
corrupted file is an error that names it, not a wrong model.
tests/test_checkpoint_crashes.py kills a rank at each of these points.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Callable

from ..errors import CheckpointError  # raised here, and imported from here

MANIFEST = "zero_fx.json"
FORMAT = 1


def staging_path(path: str) -> str:
    return f"{os.fspath(path).rstrip(os.sep)}.incomplete"


def replaced_path(path: str) -> str:
    return f"{os.fspath(path).rstrip(os.sep)}.replaced"


def checkpoint_exists(path: str) -> bool:
    """Whether ``path`` names a checkpoint that loads (possibly from where a killed save
    moved it: [Note: atomic checkpoints])."""
    return _has_manifest(readable_path(path))


def readable_path(path: str) -> str:
    """The folder to load ``path``'s checkpoint from: ``path``, or the previous checkpoint
    that a save killed between its two renames left in ``<path>.replaced``."""
    if not os.path.exists(path) and _has_manifest(replaced_path(path)):
        return replaced_path(path)
    return path


def prepare_save(path: str) -> None:
    """Rank 0, before a save: put back a checkpoint a killed save left aside, remove what
    an interrupted save staged, and refuse to replace a folder that is not a checkpoint."""
    if readable_path(path) != path:
        os.rename(replaced_path(path), path)
    if os.path.isdir(path) and os.listdir(path) and not _has_manifest(path):
        raise CheckpointError(f"{path} exists and is not a zero_fx checkpoint (it has no "
                              f"{MANIFEST}); a save would replace it: choose another folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder: choose another path")
    clear_staging(path)


def clear_staging(path: str) -> None:
    """Rank 0: remove what a save staged, before a save or after one failed (the checkpoint
    at ``path`` is untouched)."""
    shutil.rmtree(staging_path(path), ignore_errors=True)


def publish(path: str, manifest: dict) -> None:
    """Rank 0, after every rank has written: record checksums, then move the folder into place."""
    staging = staging_path(path)
    manifest = dict(manifest, format=FORMAT, files={
        name: {"bytes": os.path.getsize(os.path.join(staging, name)),
               "crc32": _crc32(os.path.join(staging, name))}
        for name in sorted(os.listdir(staging))})
    _write_manifest(staging, manifest)
    replaced = replaced_path(path)
    if os.path.exists(path):
        shutil.rmtree(replaced, ignore_errors=True)
        _rename(path, replaced)
    _rename(staging, path)
    shutil.rmtree(replaced, ignore_errors=True)


def _write_manifest(folder: str, manifest: dict) -> None:
    partial = os.path.join(folder, MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(folder, MANIFEST))


def _rename(source: str, destination: str) -> None:
    """Each of publish's two renames (one function: the crash tests kill a rank between them)."""
    os.rename(source, destination)


def _has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


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
