"""The guard's settings and pins in a file (``--kvshare-fidelity-file``), so a restarted server keeps them.

Why: per scope the guard learns which setting keeps the target, often only after several times
``--kvshare-fidelity-min-samples`` verified requests, and an operator pins agents (a judge ``dense``). Held in
memory only, a restart served every agent under the launch head again, pins included, until the evidence came
back: the agents the guard had found unsafe were served the approximation it had taken away from them.

What is kept: per scope, the setting it is under and its pin; not its estimates (every change of setting starts
them afresh anyway). A learned setting means "meets this target on this ladder", so a file written under another
target or ladder keeps only its pins. A scope is stored as its agent name and a keyed digest of its namespace
(cache salt, extra key, LoRA), never the salt itself; the key lives in the file, so the digest only hides the
salt from someone who has not read the file: keep it as private as the prompts' pool file.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Optional

FORMAT = 1
DEFAULT_NAMESPACE = (None, None, "null")  # no cache salt, no extra key, no LoRA: stored as ""
DENSE_NAME = "dense"


class GuardFileError(ValueError):
    """A guard file this server cannot use: the message names the file and what is wrong."""


def _head(name: Any, where: str) -> int:
    """``dense`` -> -1 (the controller's DENSE), ``headK`` -> K."""
    if name == DENSE_NAME:
        return -1
    if isinstance(name, str) and name.startswith("head") and name[4:].isdigit():
        return int(name[4:])
    raise GuardFileError(f"{where}: setting {name!r} is neither dense nor headK")


def _name(head: int) -> str:
    return DENSE_NAME if head < 0 else f"head{head}"


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

        Raises ``GuardFileError`` when the file exists but is not a guard file of this format.
        """
        p = Path(path)
        if not p.exists():
            if not p.parent.is_dir():
                raise GuardFileError(f"{p}: its folder does not exist")
            return cls(p)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise GuardFileError(f"{p}: not a readable guard file ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise GuardFileError(f"{p}: not a guard file of format {FORMAT} (written by --kvshare-fidelity-file)")
        try:
            key = bytes.fromhex(data["key"])
            settings = tuple(_head(s, str(p)) for s in data["settings"])
            scopes = {}
            for row in data["scopes"][-max_scopes:]:
                pinned = row.get("pinned")
                scopes[(str(row["namespace"]), str(row["agent"]))] = SavedScope(
                    _head(row["setting"], str(p)), None if pinned is None else _head(pinned, str(p)))
        except GuardFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GuardFileError(f"{p}: malformed guard file ({type(exc).__name__}: {exc})") from None
        if len(key) < 16:
            raise GuardFileError(f"{p}: its key is too short")
        target = data.get("target")
        return cls(p, key, None if target is None else str(target), settings, scopes)

    def namespace_id(self, namespace: Hashable) -> str:
        """How the file names a namespace: "" for the default one, else a keyed digest."""
        if namespace == DEFAULT_NAMESPACE:
            return ""
        return hashlib.blake2b(repr(namespace).encode(), digest_size=8, key=self.key).hexdigest()

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

    def write(self) -> None:
        """Replace the file (a temporary file renamed over it: a crash leaves the old file or the new one)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, self.path)
