"""Saved steps: a process compiling a step that an earlier process compiled loads the rewritten
graph that process wrote, instead of capturing the step and running our passes again.

[Note: saved steps]
A restart (after a preemption, the next run of a sweep, the next test) compiles the same step
again: dynamo's trace, the capture, our passes and the lowering, every one of them the same
work with the same result. After a step's first compilation, each rank writes the graph our
passes made ([Note: a graph as bytes] in graph_files.py) to
``$ZERO_FX_CACHE_DIR/<step>/rank<r>-<fingerprint>.zfx`` (default ``~/.cache/zero_fx``). A
later process's compilation of a step with the same fingerprint loads it in place of the
capture and the passes; dynamo still traces the step (its guards and the step's Python state
are its own), and the graph is still lowered (Inductor's caches make that fast).

The fingerprint is a digest of what decides the rewritten graph, each part digested on its
own so that a miss can say which part differs from the step's newest saved file:
- the capture's key ([Note: kept captures] in zero_fx/capture/kept_captures.py): dynamo's code
  and the functions it calls, by qualified name; each input's layout and which parameter it is;
  grad mode, autocast, the attention kernels;
- the graph's inputs as lowered (the shards), the world and mesh, the plan (whole: layouts,
  stage, rank, buckets), the options (whole) and what the first call decided;
- Inductor's and AOTAutograd's settings, the names of zero_fx a patch of the user's code
  rebinds (``_patched_functions``), the torch version, a digest of zero_fx's source (its
  version with it), and the device's name.
Whatever ``reuse.structure_key`` cannot read is not saved either: dynamic shapes, dumps, a
compiler of the user's, an offload choice still to make, a value known by its identity.

Each step name and rank keeps its ``KEPT_PER_STEP`` newest saved steps. A file is the line
``zero_fx saved step 1``, a JSON header (each part's digest, the payload's
length and SHA-256) and the payload; it is written to a temporary name and renamed, so a
reader sees a whole file or none. One whose length or digest does not match (a truncated
copy, a disk error) is reported and compiled from scratch; nothing is unpickled before its
digest matches. The payload is a pickle: load saved steps only from a folder you trust, as
with Inductor's own cache.

Before any rank uses a saved step, the ranks agree on it: each gives the fingerprint of the
graph it loaded (``graph_signature``, or 0 for none) in one 8-byte all-gather, and unless
all hold the same graph every rank compiles from scratch (and saves what it compiled). A
rank with a stale or foreign file thus cannot run a program the others do not.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import site
import sysconfig
import sys
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch
from torch.fx import GraphModule

from ..base.compat import torch_version
from ..capture.kept_captures import capture_parts
from . import reuse
from .graph_files import NotSavable, graph_bytes, graph_from_bytes

log = logging.getLogger("zero_fx")

CACHE_DIR_ENV = "ZERO_FX_CACHE_DIR"
"""The folder saved steps are written to and read from (default ``~/.cache/zero_fx``)."""

SAVED_STEPS_ENV = "ZERO_FX_SAVED_STEPS"
"""Set to ``0`` to neither write nor read saved steps in this process (as
``zero_compile(saved_steps=False)``)."""

KEPT_PER_STEP = 8
"""Saved steps kept per step name and rank (the newest): an older one is deleted when a
newer one is written, so that a step whose code or shapes keep changing does not fill the
disk."""

MAGIC = b"zero_fx saved step 1\n"
SUFFIX = ".zfx"


def enabled(option: bool) -> bool:
    """Saved steps are on: the option, and the environment does not turn them off."""
    return option and os.environ.get(SAVED_STEPS_ENV, "1").strip().lower() not in ("0", "false", "off")


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_DIR_ENV) or pathlib.Path.home() / ".cache" / "zero_fx")


@dataclass(frozen=True)
class SavedStepKey:
    """Where one compilation's saved step lives, and what its fingerprint is made of."""

    path: pathlib.Path
    parts: dict
    """Each part of the fingerprint ([Note: saved steps]) -> its digest."""

    @property
    def reuse_key(self) -> str:
        """The key a loaded step's compilation is kept under for later steps of the process
        ([Note: one compilation per step structure] in reuse.py)."""
        return f"saved {self.path.name}"


def saved_step_key(step_name: str, capture_key: Optional[Hashable], inputs: Sequence[Any],
                   names: Sequence[Optional[str]], plan, config, decided: tuple,
                   ) -> Optional[SavedStepKey]:
    """The saved step of this compilation, or None where it is neither loaded nor saved
    (``capture_key`` None, or a value known only by its identity)."""
    if capture_key is None:
        return None
    try:
        parts = dict(capture_parts(capture_key))
        parts["the graph's inputs"] = reuse.described(
            [(name, value) for name, value in zip(list(names) + [None] * len(inputs), inputs)])
        parts["the world size and mesh"] = repr((plan.world_size, plan.replicas, config.mesh))
        parts["the plan"] = reuse.described(plan)
        parts["the options"] = reuse.described(config)
        parts["the first call's decisions"] = reuse.described(decided)
        parts["lowering settings and zero_fx's functions"] = "\n".join(
            reuse.lowering_settings() + _patched_functions())
    except reuse.NotReusable as why:
        log.debug("zero_fx: %s is not saved: %s", step_name, why)
        return None
    parts["the torch version"] = torch_version()
    parts["zero_fx's source"] = _zero_fx_source()
    parts["the device"] = _device_name(inputs)
    digests = {part: hashlib.sha256(text.encode()).hexdigest()[:16] for part, text in parts.items()}
    fingerprint = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:32]
    folder = cache_dir() / re.sub(r"[^A-Za-z0-9_.-]", "_", step_name)
    return SavedStepKey(folder / f"rank{plan.rank}-{fingerprint}{SUFFIX}", digests)


def load(key: SavedStepKey, step_name: str) -> Optional[GraphModule]:
    """The graph saved under ``key``; None (with a log line saying why) where there is none,
    or it is damaged."""
    try:
        data = key.path.read_bytes()
    except FileNotFoundError:
        _log_nearest_miss(key, step_name)
        return None
    except OSError as why:
        log.warning("zero_fx: %s compiles from scratch: its saved step %s cannot be read (%s)",
                    step_name, key.path, why)
        return None
    header, payload, damage = _split(data)
    if damage is None and header.get("parts") != key.parts:
        damage = "its header does not match its name"
    if damage is not None:
        log.warning("zero_fx: %s compiles from scratch: its saved step %s is damaged (%s)",
                    step_name, key.path, damage)
        return None
    try:
        return graph_from_bytes(payload)
    except Exception as why:  # a file of another zero_fx whose digest matched
        log.warning("zero_fx: %s compiles from scratch: its saved step %s does not load (%s: %s)",
                    step_name, key.path, type(why).__name__, why)
        return None


def save(key: SavedStepKey, gm: GraphModule, step_name: str) -> None:
    """Write ``gm`` as the saved step of ``key`` (a step that cannot be written is logged and
    left unsaved: saving never fails a compilation)."""
    try:
        payload = graph_bytes(gm)
    except NotSavable as why:
        log.debug("zero_fx: %s is not saved: %s", step_name, why)
        return
    header = {"parts": key.parts, "payload_bytes": len(payload),
              "payload_sha256": hashlib.sha256(payload).hexdigest(),
              "step": step_name, "torch": torch_version()}
    temporary = key.path.with_name(f".{key.path.name}.{os.getpid()}.tmp")
    try:
        key.path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)
        os.replace(temporary, key.path)
    except OSError as why:
        log.warning("zero_fx: %s: its compilation could not be saved to %s (%s)", step_name,
                    key.path, why)
        temporary.unlink(missing_ok=True)
        return
    log.info("zero_fx: saved %s's compilation to %s (%.1f kB)", step_name, key.path,
             key.path.stat().st_size / 1e3)
    for old in _saved_of_rank(key)[:-KEPT_PER_STEP]:
        old.unlink(missing_ok=True)


def _saved_of_rank(key: SavedStepKey) -> list[pathlib.Path]:
    """The saved steps of ``key``'s step and rank, oldest first."""
    rank = key.path.name.split("-")[0]
    try:
        return sorted(key.path.parent.glob(f"{rank}-*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
    except OSError:  # one deleted meanwhile by another process
        return []


def _split(data: bytes) -> tuple[dict, bytes, Optional[str]]:
    """The header and payload of a saved step's bytes, and what is wrong with them (None)."""
    if not data.startswith(MAGIC):
        return {}, b"", "not a zero_fx saved step of this format"
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC):end]) if end >= 0 else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        return {}, b"", "its header is cut or unreadable"
    payload = data[end + 1:]
    if len(payload) != header.get("payload_bytes"):
        return header, b"", f"truncated: {len(payload)} of {header.get('payload_bytes')} bytes"
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        return header, b"", "its contents do not match their digest"
    return header, payload, None


def _log_nearest_miss(key: SavedStepKey, step_name: str) -> None:
    """Say what differs between this compilation and the newest saved step of the same step
    and rank, if there is one."""
    others = _saved_of_rank(key)
    if not others:
        log.debug("zero_fx: %s has no saved step in %s", step_name, key.path.parent)
        return
    newest = others[-1]
    try:
        with open(newest, "rb") as file:
            header, _, _ = _split(file.read())
    except OSError:
        header = {}
    parts = header.get("parts") or {}
    differing = [part for part, digest in key.parts.items() if parts.get(part) != digest]
    log.info("zero_fx: %s compiles from scratch: the saved step %s was made for another %s",
             step_name, newest.name, ", ".join(differing) or "fingerprint")


def _patched_functions() -> list[str]:
    """The names of zero_fx's modules bound to a function of the user's code (a script, a
    test: anything not installed, nor Python's own), each with that function's qualified
    name: a patch. Only these: which of zero_fx's modules a process has imported differs
    between processes (a long-lived one has imported more), so listing every binding, as the
    kept compilations do, would tell apart processes that compile alike."""
    patched = []
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith("zero_fx."):
            continue
        for attr, value in sorted(vars(module).items()):
            if callable(value) and not isinstance(value, type) and _users(value):
                patched.append(f"{name}.{attr}={_qualified_name(value)}")
    return patched


def _users(value: Any) -> bool:
    """``value`` was defined by the user's code: a module outside zero_fx whose file is not
    installed (site-packages) nor Python's own."""
    module_name = getattr(value, "__module__", None) or type(value).__module__
    if module_name.split(".")[0] == "zero_fx":
        return False
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if path is None:
        return module_name == "__main__"
    path = os.path.realpath(path)
    return not any(path.startswith(prefix) for prefix in _installed_folders())


@functools.lru_cache(maxsize=1)
def _installed_folders() -> tuple[str, ...]:
    folders = set(site.getsitepackages()) | {site.getusersitepackages()}
    folders |= {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.realpath(f) + os.sep for f in folders if f)


def _qualified_name(value: Any) -> str:
    """A function as another process names it; one made in a closure (or a lambda) by its
    identity, which no other process matches."""
    qualname = getattr(value, "__qualname__", None) or type(value).__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        return f"{qualname} {id(value):x}"
    return f"{getattr(value, '__module__', '')}.{qualname}"


@functools.lru_cache(maxsize=1)
def _zero_fx_source() -> str:
    """A digest of zero_fx's sources (its passes' folder too, its version with them), read
    once."""
    from .. import passes

    digest = hashlib.sha256()
    for root in (pathlib.Path(__file__).parents[1], pathlib.Path(passes.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _device_name(inputs: Sequence[Any]) -> str:
    devices = sorted({value.device.type for value in inputs if isinstance(value, torch.Tensor)})
    if "cuda" in devices and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    return ",".join(devices) or "cpu"
