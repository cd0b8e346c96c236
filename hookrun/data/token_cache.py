"""A tokenized corpus kept in the run's folder, `<run dir>/.tokens/<key>/`: the ranks of one
torchrun job tokenize the corpus once between them, and a resumed run (or a run after its
dry run) does not tokenize it again.

The key is a sha256 over what the ids depend on: the corpus files' paths and bytes, the
tokenizer (its serialized vocabulary and rules), the dataset settings and the rows the run
needs (`limit`). Whoever first takes the folder's lock (flock: released by the kernel when
its holder dies, however it dies) tokenizes into `<key>.part-<pid>/` and renames it to
`<key>/` when it is whole; the others wait on the lock and then read it. A part left by a
killed process is removed; a cache whose ids do not match the sha256 it recorded (a
truncated or changed file) is made again. The run removes the folder when it completes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hookrun.data.token_file import TokenFile

__all__ = ["FOLDER", "cached", "corpus_key", "remove"]

log = logging.getLogger("hookrun")

FOLDER = ".tokens"  # in the run's folder
_IDS, _DOCS = "ids.int32", "docs.npz"
_READ = 1 << 20


def corpus_key(files: list[Path], tokenizer: Any, settings: dict[str, Any]) -> str:
    """sha256 over the files' paths and bytes, the tokenizer and `settings`."""
    digest = hashlib.sha256(b"hookrun token cache 1\n")
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode() + b"\n")
    digest.update(_tokenizer_identity(tokenizer))
    for file in files:
        digest.update(f"\n{os.path.abspath(file)}\n".encode())
        with open(file, "rb") as f:
            while part := f.read(_READ):
                digest.update(part)
    return digest.hexdigest()


def _tokenizer_identity(tokenizer: Any) -> bytes:
    """What decides a tokenizer's ids: a fast tokenizer's whole serialized form, else its
    class, vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.to_str().encode()
    vocab = sorted(tokenizer.get_vocab().items())
    return repr((type(tokenizer).__name__, vocab, tokenizer.all_special_tokens)).encode()


def cached(
    folder: Path, key: str, tokenize: Callable[[TokenFile], dict[str, Any]]
) -> tuple[TokenFile, dict[str, Any]]:
    """The ids and what `tokenize` said of them (arrays, ints, a list of str), from
    `folder/key` when it is whole, else made by `tokenize(store)` and kept there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        held = _lock(folder / "lock")  # waits while another rank tokenizes
    except OSError as err:  # a read-only run folder: tokenize as before, for this process
        log.warning("dataset: no token cache in %s (%s); tokenizing here", folder, err)
        store = TokenFile()
        return store, tokenize(store)
    home = folder / key
    try:
        if home.is_dir():
            found = _load(home)
            if found is not None:
                log.info("dataset: %d tokens read from the token cache %s", found[0].size, home)
                return found
            log.warning("dataset: the token cache %s is damaged; tokenizing again", home)
            shutil.rmtree(home)
        for stale in folder.glob("*.part-*"):  # a killed maker's; the lock says none is alive
            shutil.rmtree(stale, ignore_errors=True)
        part = folder / f"{key}.part-{os.getpid()}"
        part.mkdir()
        try:
            store = TokenFile(part / _IDS)
            said = tokenize(store)
            _save(part, said, _sha256(part / _IDS))
            os.replace(part, home)  # whole, or not there: a rename
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise
    finally:
        os.close(held)  # releases the lock
    log.info("dataset: %d tokens tokenized into the token cache %s", store.size, home)
    return store, said


def remove(run_dir: Path) -> None:
    """The run's token cache, once the run is complete."""
    shutil.rmtree(run_dir / FOLDER, ignore_errors=True)


def _lock(path: Path) -> int:
    """An open descriptor of `path` holding its exclusive flock (closing it releases it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


def _save(part: Path, said: dict[str, Any], sha256: str) -> None:
    arrays = {k: np.asarray(v) for k, v in said.items() if isinstance(v, np.ndarray)}
    plain = {k: v for k, v in said.items() if k not in arrays}
    with open(part / _DOCS, "xb") as f:
        np.savez(f, **arrays, said=np.array(json.dumps({**plain, "sha256": sha256})))


def _load(home: Path) -> tuple[TokenFile, dict[str, Any]] | None:
    """The cache in `home`, or None when it is damaged (unreadable, or its ids changed)."""
    try:
        with np.load(home / _DOCS, allow_pickle=False) as docs:
            said = json.loads(str(docs["said"]))
            said |= {k: docs[k] for k in docs.files if k != "said"}
        if _sha256(home / _IDS) != said.pop("sha256"):
            return None
        return TokenFile.reopened(home / _IDS), said
    except Exception:  # noqa: BLE001  (a cut zip, bad JSON, a missing key: made again)
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while part := f.read(_READ):
            digest.update(part)
    return digest.hexdigest()
