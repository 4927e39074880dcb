"""The guard's settings and pins in a file (``--kvshare-fidelity-file``), so a restarted server keeps them.

Why: per scope the guard learns which setting keeps the target, often only after several times
``fidelity_min_samples`` verified requests, and an operator pins agents (a judge ``dense``). Held in
memory only, a restart served every agent under the launch head again, pins included, until the evidence came
back: the agents the guard had found unsafe were served the approximation it had taken away from them.

What is kept: per scope, the setting it is under and its pin; not its estimates (every change of setting starts
them afresh anyway). A learned setting means "meets this target on this ladder", so a file written under another
target or ladder keeps only its pins. A scope is stored as its agent name and a keyed digest of its namespace
(cache salt, extra key, LoRA), never the salt itself; the key lives in the file, so the digest only hides the
salt from someone who has not read the file: keep it as private as the prompts' pool file. The same key, derived
per use (``derived_key``), names automatic-mode agents and namespaces on the admin view, so those names survive a
restart and the pins made on them still apply.

How it is read: a bounded read of a regular file (never through a symbolic link), then a strict schema (``_Content``:
exact types, no unknown fields, bounded sizes); a setting is held to the bound requests are
(``protocol.MAX_RECOMPUTE_HEAD``), so no pin restored from the file can make its agent's requests invalid. How it
is written: as the pool file is, a new file (``mkstemp``, mode 0600) in the same folder moved over the old one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Hashable, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from sglang_kvshare.protocol import MAX_NAME_CHARS, MAX_RECOMPUTE_HEAD

FORMAT = 1
DEFAULT_NAMESPACE = (None, None, "null")  # no cache salt, no extra key, no LoRA: stored as ""
DENSE_NAME = "dense"
MAX_FILE_BYTES = 4 << 20  # far above what MAX_ROWS rows take; a larger file is not one this server wrote
MAX_ROWS = 4096  # scopes in the file (the guard keeps fewer: its scope and pin bounds)
MAX_SETTINGS = 32  # the ladder's length
_SETTING = re.compile(r"head([0-9]{1,6})")


class GuardFileError(ValueError):
    """A guard file this server cannot use: the message names the file and what is wrong."""


def parse_setting(name: str) -> int:
    """``dense`` -> -1 (the controller's DENSE), ``headK`` -> K for 0 <= K <= ``MAX_RECOMPUTE_HEAD``.

    The one check of a setting's name, for pins and for the guard file: a head is held to the bound request
    validation holds a request's ``recompute_head`` to, since the guard writes the setting into its requests.
    Raises ``ValueError`` saying what is accepted.
    """
    if name == DENSE_NAME:
        return -1
    match = _SETTING.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"setting {str(name)[:40]!r}: use dense or headK (e.g. head16)")
    head = int(match.group(1))
    if head > MAX_RECOMPUTE_HEAD:
        raise ValueError(f"setting {name!r}: a head of at most {MAX_RECOMPUTE_HEAD} tokens (the bound of a "
                         "request's recompute_head)")
    return head


def _name(head: int) -> str:
    return DENSE_NAME if head < 0 else f"head{head}"


_Setting = Annotated[int, BeforeValidator(parse_setting)]  # a name in the file, a head (or -1) in memory


def _check_format(value: int) -> int:
    if value != FORMAT:
        raise ValueError(f"format {value}, not {FORMAT}")
    return value


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    namespace: str = Field(pattern=r"^(|[0-9a-f]{16})$")
    agent: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    setting: _Setting
    pinned: Optional[_Setting] = None


class _Content(BaseModel):
    """The file's schema: exact JSON types (no ``true`` for 1, no string for a number), no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Annotated[int, AfterValidator(_check_format)]
    key: str = Field(pattern=r"^(?:[0-9a-f]{2}){16,64}$")
    target: Optional[str] = Field(default=None, min_length=1, max_length=64)
    settings: list[_Setting] = Field(max_length=MAX_SETTINGS)
    scopes: list[_Row] = Field(max_length=MAX_ROWS)


@dataclass
class SavedScope:
    """One scope's setting (a head, or -1 for dense) and pin (None: not pinned)."""

    setting: int
    pinned: Optional[int] = None


@dataclass
class GuardFile:
    """The file's content in memory; ``write`` replaces the file atomically."""

    path: Path
    key: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    target: Optional[str] = None
    settings: tuple[int, ...] = ()
    scopes: dict[tuple[str, str], SavedScope] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike, max_scopes: int = 256) -> "GuardFile":
        """The file at ``path``, or an empty one (written on the first change) when none exists there.

        Raises ``GuardFileError`` when the file exists but is not a guard file of this format, or ``path`` is a
        symbolic link or not a regular file.
        """
        p = Path(path)
        if not os.path.lexists(p):
            if not p.parent.is_dir():
                raise GuardFileError(f"{p}: its folder does not exist")
            return cls(p)
        data = _validated(p, _read(p))
        scopes = {(row.namespace, row.agent): SavedScope(row.setting, row.pinned)
                  for row in data.scopes[-max_scopes:]}
        return cls(p, bytes.fromhex(data.key), data.target, tuple(data.settings), scopes)

    @classmethod
    def create(cls, path: str | os.PathLike, max_scopes: int = 256) -> "GuardFile":
        """``open``, and write the file at once when there was none, so its key is fixed from the launch on.

        Created exclusively: of servers creating it together, one file wins and every one of them reads it.
        Raises ``GuardFileError`` as ``open`` does, or when the file cannot be created.
        """
        opened = cls.open(path, max_scopes)
        if os.path.lexists(opened.path):
            return opened
        try:
            opened.write(exclusive=True)
        except FileExistsError:
            return cls.open(path, max_scopes)
        except OSError as exc:
            raise GuardFileError(f"{opened.path}: cannot be created ({exc.strerror or exc})") from None
        return opened

    def namespace_id(self, namespace: Hashable) -> str:
        """How the file names a namespace: "" for the default one, else a keyed digest."""
        if namespace == DEFAULT_NAMESPACE:
            return ""
        return hashlib.blake2b(repr(namespace).encode(), digest_size=8, key=self.key).hexdigest()

    def derived_key(self, purpose: str) -> bytes:
        """A 16-byte key for ``purpose``, derived from the file's key: stable while the file is, and unrelated to
        the key itself or to the key of another purpose. Never shown."""
        return hashlib.blake2b(purpose.encode(), digest_size=16, key=self.key, person=b"kvshare-guard").digest()

    def under(self, target: Optional[str], settings: tuple[int, ...]) -> bool:
        """Make the file describe ``target`` on ``settings``; True when it already did. Otherwise every learned
        setting is dropped (it meant "meets the old target on the old ladder") and only the pins stay."""
        if (self.target, tuple(self.settings)) == (target, tuple(settings)):
            return True
        self.scopes = {k: SavedScope(settings[0] if settings else 0, s.pinned)
                       for k, s in self.scopes.items() if s.pinned is not None}
        self.target, self.settings = target, tuple(settings)
        return False

    def to_json(self) -> dict:
        return {"format": FORMAT, "key": self.key.hex(), "target": self.target,
                "settings": [_name(h) for h in self.settings],
                "scopes": [{"namespace": ns, "agent": agent, "setting": _name(s.setting),
                            "pinned": None if s.pinned is None else _name(s.pinned)}
                           for (ns, agent), s in self.scopes.items()]}

    def write(self, exclusive: bool = False) -> None:
        """Replace the file: a new file (``mkstemp``: a fresh name, mode 0600, never a planted link followed) in
        the same folder, moved over the old one, so a crash leaves the old file or the new one. ``exclusive``:
        only where no file is (``FileExistsError`` otherwise). Raises ``OSError`` when it cannot be written."""
        text = json.dumps(self.to_json(), indent=1) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o600)  # it holds the namespace key
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                os.link(tmp, self.path)  # fails where a file (or a link) already is
                os.unlink(tmp)
            else:
                os.replace(tmp, self.path)  # a link at the path is replaced, never followed
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _read(p: Path) -> bytes:
    """The file's bytes: a regular file of at most ``MAX_FILE_BYTES``, never through a symbolic link."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if os.path.islink(p):
            raise GuardFileError(f"{p} is a symbolic link: point --kvshare-fidelity-file at the file itself") from None
        raise GuardFileError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise GuardFileError(f"{p} is not a regular file")
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise GuardFileError(f"{p}: larger than {MAX_FILE_BYTES} bytes: not a guard file this server wrote")
    return raw


def _validated(p: Path, raw: bytes) -> _Content:
    """The file's content through the strict schema; what is wrong in the message (never the content itself:
    the file holds the key)."""
    try:
        return _Content.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
    if errors[0]["type"].startswith("json_") or errors[0]["type"] == "recursion_loop":
        raise GuardFileError(f"{p}: not a readable guard file ({errors[0]['msg']})")
    if errors[0]["type"] == "model_type" or any(e["loc"][:1] == ("format",) for e in errors):
        raise GuardFileError(f"{p}: not a guard file of format {FORMAT} (written by --kvshare-fidelity-file)")
    where = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors[:3])
    raise GuardFileError(f"{p}: malformed guard file ({where})")
