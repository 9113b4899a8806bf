"""Whether a checkpoint on disk is the one that was written: a record of its files.

Just before a save commits (the rename of its temporary directory) the primary process
writes ``zero_jax.files.json``: every file's size and a SHA-256 of the small ones.
`problem` checks a step directory against it (missing items and files, truncated or
overwritten ones, the store's own metadata); large array files are checked by size and
by TensorStore's checksums on read. The checkpoints guide explains the design.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Sequence

import orbax.checkpoint as ocp
from etils import epath

from zero_jax import _compat

RECORD = "zero_jax.files.json"
"""The record of a step's files, at the top of the step directory."""
RECORD_KEY = "files_record"
"""The entry of the zero_jax JSON that names the record (absent before records existed)."""
HASHED_BYTES = 1 << 20
"""Files up to this size are hashed; larger ones (array data) are checked by size."""
_FORMAT = "zero_jax.files/1"
_ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
# Written by Orbax's commit after the record (so not in it), or the record itself.
_UNRECORDED = (_ORBAX_STEP_METADATA, "commit_success.txt", RECORD)
_MAX_NAMED = 4
_hashed: dict[str, tuple] = {}  # path -> (stat key, digest) of a file hashed before


class DamagedCheckpointError(ValueError, OSError):
  """A checkpoint's files are not those its save wrote (missing, truncated, altered).

  A ``ValueError`` (its content is invalid) and an ``OSError`` (what is on
  disk is wrong), so that handlers written for either catch it.
  """


class DamagedCheckpointWarning(UserWarning):
  """A restore skipped a damaged checkpoint and took an older, intact one."""


# ------------------------------------------------------------------- writing
def _digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()[:32]


def _files_digest(files: dict) -> str:
  return _digest(json.dumps(files, sort_keys=True).encode())


def _walk(step_dir: epath.Path):
  """``(relative name, path)`` of every file under ``step_dir``."""
  for parent, _, names in step_dir.walk():
    for name in names:
      path = parent / name
      yield path.relative_to(step_dir).as_posix(), path


def write_record(step_dir: epath.Path) -> None:
  """Writes ``step_dir/zero_jax.files.json`` for the files now in ``step_dir``."""
  files = {}
  for rel, path in _walk(step_dir):
    if rel in _UNRECORDED:
      continue
    size = path.stat().length
    files[rel] = [size, _digest(path.read_bytes()) if size <= HASHED_BYTES else None]
  record = {"format": _FORMAT, "files": files, "digest": _files_digest(files)}
  (step_dir / RECORD).write_text(json.dumps(record, sort_keys=True))


def recording_temporary_path_class(directory: epath.Path) -> type:
  """Orbax's temporary-path class for ``directory``, writing the record before the commit.

  Orbax finalizes each item's directory and then the step's, on the primary
  process, after every process has written its arrays. At the step's
  finalize (the one whose final path is directly under ``directory``) the
  record is written into the still-temporary directory, then Orbax commits.
  """
  base = _compat.orbax_temporary_path_class(directory)

  class RecordingTemporaryPath(base):  # pylint: disable=missing-class-docstring
    async def finalize(self, *args, **kwargs):
      if self.get_final().parent == directory:
        await asyncio.to_thread(write_record, self.get())
      return await super().finalize(*args, **kwargs)

  return RecordingTemporaryPath


# ------------------------------------------------------------------- checking
def _read_record(step_dir: epath.Path) -> tuple[dict | None, str | None]:
  """The recorded files, or None and what is wrong with the record."""
  try:
    record = json.loads((step_dir / RECORD).read_text())
    files = record["files"]
    if record.get("format") != _FORMAT or record.get("digest") != _files_digest(files):
      return None, f"its record of files, {RECORD}, is altered"
    return files, None
  except FileNotFoundError:
    return None, f"its record of files, {RECORD}, is missing"
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return None, f"its record of files, {RECORD}, is unreadable ({e})"


def _stat(path: epath.Path) -> tuple[int, tuple]:
  """``(size, key)``: the key changes whenever the file is written (also when its
  modification time is set back: the change time cannot be)."""
  p = os.fspath(path)
  if "://" in p:
    st = path.stat()
    return st.length, (st.length, st.mtime)
  st = os.stat(p)
  return st.st_size, (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _hash(path: epath.Path, key: tuple) -> str:
  known = _hashed.get(os.fspath(path))
  if known is None or known[0] != key:
    known = (key, _digest(path.read_bytes()))
    _hashed[os.fspath(path)] = known
  return known[1]


def _file_problem(path: epath.Path, size: int, digest: str | None) -> str | None:
  try:
    actual, key = _stat(path)
  except FileNotFoundError:
    return "missing"
  if actual != size:
    return f"{actual} bytes, the save wrote {size} (truncated or overwritten)"
  if digest is not None and _hash(path, key) != digest:
    return "its content differs from what the save wrote (corrupted)"
  return None


def _named(problems: list[str]) -> str:
  shown = "; ".join(problems[:_MAX_NAMED])
  more = len(problems) - _MAX_NAMED
  return shown + (f"; and {more} more file(s)" if more > 0 else "")


def _missing_items(step_dir: epath.Path, names: Sequence[str]) -> list[str]:
  """The top-level items (``state/``, ...) of ``names`` whose directory is gone."""
  tops = sorted({n.split("/", 1)[0] for n in names if "/" in n})
  return [t for t in tops if not (step_dir / t).exists()]


def orbax_metadata_problem(step_dir: epath.Path) -> str | None:
  try:
    json.loads((step_dir / _ORBAX_STEP_METADATA).read_text())
  except FileNotFoundError:
    return f"Orbax's step metadata {_ORBAX_STEP_METADATA} is missing"
  except (OSError, ValueError) as e:
    return f"Orbax's step metadata {_ORBAX_STEP_METADATA} is unreadable ({e})"
  return None


def _legacy_problem(step_dir: epath.Path, description: str, record_problem: str) -> str | None:
  """For a step without a record: None if its save wrote none (an older version)."""
  try:
    meta = json.loads((step_dir / description).read_text())
  except (OSError, ValueError) as e:
    return f"{description} is unreadable ({e})"
  return record_problem if isinstance(meta, dict) and meta.get(RECORD_KEY) else None


def problem(step_dir: epath.Path, *, required: Sequence[str], description: str,
            extra=orbax_metadata_problem) -> str | None:
  """What is wrong with the checkpoint in ``step_dir``, or None if it is intact.

  Args:
    step_dir: one step's directory.
    required: files every complete save writes, relative to ``step_dir``.
    description: the zero_jax JSON (relative to ``step_dir``); its
      ``files_record`` entry says that the save wrote a record.
    extra: the store's own check of an intact-looking step (Orbax's metadata).

  Returns:
    None, or a phrase naming the damage, e.g. ``"the item directory state/ is
    missing"``.
  """
  files, record_problem = _read_record(step_dir)
  if files is None and (step_dir / RECORD).exists():
    return record_problem
  names = list(required) + list(files or {})
  gone = _missing_items(step_dir, names)
  if gone:
    listed = ", ".join(g + "/" for g in gone)
    return (f"the item directories {listed} are missing" if len(gone) > 1 else
            f"the item directory {listed} is missing")
  missing = [n for n in required if not (step_dir / n).exists()]
  if missing:
    return "missing " + ", ".join(missing)
  if files is None:
    return _legacy_problem(step_dir, description, record_problem) or extra(step_dir)
  bad = []
  for name, (size, digest) in files.items():
    why = _file_problem(step_dir / name, size, digest)
    if why:
      bad.append(f"{name}: {why}")
  if bad:
    return _named(bad)
  return extra(step_dir)


def step_dirs(directory: epath.Path) -> list[int]:
  """The steps that have a directory in ``directory``, intact or not, ascending."""
  try:
    names = [p.name for p in directory.iterdir()]
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted(int(n) for n in names
                if n.isascii() and n.isdigit() and (directory / n).is_dir())


def holds_saves(directory: epath.Path, description: str) -> bool:
  """Whether a step directory in ``directory`` holds a file a save writes (number-named
  folders alone, as in /proc, are not checkpoints; nor is one that vanishes meanwhile)."""
  return any((directory / str(s) / name).exists()
             for s in step_dirs(directory) for name in (RECORD, description))


def damaged_error(directory, step: int, problem: str, intact: list[int]) -> DamagedCheckpointError:
  """The error for restoring the damaged checkpoint of ``step``, naming the intact ones."""
  then = (f"The intact checkpoints there are steps {intact}: restore one with step=, or "
          f"without step= for the newest intact one." if intact else
          "There is no intact checkpoint there.")
  return DamagedCheckpointError(f"the checkpoint of step {step} in {directory} is "
                                f"damaged: {problem}. {then}")


def nothing_to_restore(directory: epath.Path) -> FileNotFoundError:
  """The error for a directory without a checkpoint; safetensors files there are named (an
  export of parameters, read with `zero_jax.load_safetensors`, not restored)."""
  if not directory.is_dir():
    return FileNotFoundError(f"no complete checkpoint in {directory} (the directory does not "
                             f"exist): nothing to restore. Check the path, or start from "
                             f"step.init(params).")
  if (directory / "_METADATA").is_file() and not (directory / RECORD).exists():
    return FileNotFoundError(
        f"{directory} holds an export of parameters (zj.export_params: a plain Orbax PyTree "
        f"checkpoint, its _METADATA at the top), not a CheckpointManager checkpoint: an "
        f"export has the parameters only, no optimizer state. Read it with params = "
        f"orbax.checkpoint.StandardCheckpointer().restore({os.fspath(directory)!r}), then "
        f"start from step.init(params).")
  exported = sorted(p.name for p in directory.iterdir()
                    if p.name.endswith((".safetensors", ".safetensors.index.json")))
  if not exported:
    return FileNotFoundError(f"no complete checkpoint in {directory}: nothing to restore. "
                             f"Check the path, or start from step.init(params).")
  return FileNotFoundError(
      f"{directory} holds a safetensors export ({', '.join(exported[:_MAX_NAMED])}), not a "
      f"CheckpointManager checkpoint: an export has the parameters only, no optimizer state. "
      f"Read it with params = zj.load_safetensors({os.fspath(directory)!r}, params_like, "
      f"step=step), then start from step.init(params, donate=True).")
