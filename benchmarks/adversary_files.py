"""Hostile guard and pool files handed to the launcher: each must stop the launch with a message naming the file.

A guard file goes to the launcher's own check (``launcher.parse_kvshare``, no server): it is read before SGLang
starts, and a file that crashes the launcher with an uncaught exception, or passes, fails its verdict. A pool
file can be judged only against the model's KV layout, which the scheduler knows, so each hostile pool file is a
real launch that must exit with an error naming the file before it answers; the files are made from a pool file
the running server wrote (its model identity exactly as the server checks it).
"""

from __future__ import annotations

import io
import json
import secrets
import tempfile
import time
from contextlib import redirect_stderr
from pathlib import Path
from typing import Callable, Optional

import requests
import torch

NEST_DEPTH = 100_000  # deeper than any recursion limit


def launch_check(argv: list[str]) -> dict:
    """Run the launcher's argument and file checks on ``argv``: ``refused`` (it exited with an error),
    ``crashed`` (an exception other than the launcher's own exit) and its message."""
    from sglang_kvshare.server import launcher

    err = io.StringIO()
    try:
        with redirect_stderr(err):
            launcher.parse_kvshare(argv)
    except SystemExit as exc:
        return {"refused": exc.code not in (0, None), "crashed": None, "message": err.getvalue().strip()[-400:]}
    except BaseException as exc:  # noqa: BLE001 - an uncaught error at launch is what this check looks for
        return {"refused": False, "crashed": type(exc).__name__, "message": str(exc)[:400]}
    return {"refused": False, "crashed": None, "message": ""}


# ------------------------------------------------------------ guard files
def _guard(**change) -> dict:
    base = {"format": 1, "key": secrets.token_hex(16), "target": None, "settings": ["head0", "dense"],
            "scopes": [{"namespace": "", "agent": "judge", "setting": "head0", "pinned": "dense"}]}
    return {**base, **change}


def _row(**change) -> list:
    return [{"namespace": "", "agent": "judge", "setting": "head0", "pinned": None, **change}]


GUARD_CASES: dict[str, Callable[[], str]] = {
    "deep_nesting": lambda: ('{"format": 1, "key": "%s", "settings": [], "scopes": ' % secrets.token_hex(16)
                             + "[" * NEST_DEPTH + "]" * NEST_DEPTH + "}"),
    "format_true": lambda: json.dumps(_guard(format=True)),
    "format_string": lambda: json.dumps(_guard(format="1")),
    "key_number": lambda: json.dumps(_guard(key=5)),
    "scopes_string": lambda: json.dumps(_guard(scopes="judge")),
    "agent_list": lambda: json.dumps(_guard(scopes=_row(agent=["judge"]))),
    "namespace_number": lambda: json.dumps(_guard(scopes=_row(namespace=5))),
    "target_list": lambda: json.dumps(_guard(target=["top1>=0.99"])),
    "pinned_true": lambda: json.dumps(_guard(scopes=_row(pinned=True))),
    "unknown_field": lambda: json.dumps({**_guard(), "salt": "x"}),
    "pin_past_bound": lambda: json.dumps(_guard(scopes=_row(pinned="head70000"))),
    "setting_past_bound": lambda: json.dumps(_guard(scopes=_row(setting="head70000"))),
}


def guard_file_writes(folder: Path) -> dict:
    """A guard file written where an attacker planted the temp name beside it as a symlink to a file of theirs:
    the write must not follow the link, and the guard file (it holds the namespace key) must be private."""
    import stat

    from sglang_kvshare.guard.saved import GuardFile

    path, victim = folder / "guard.json", folder / "victim.txt"
    victim.write_text("victim\n")
    (folder / f".{path.name}.tmp").symlink_to(victim)
    GuardFile.open(path).write()
    mode = stat.S_IMODE(path.lstat().st_mode) if path.exists() else None
    followed = victim.read_text() != "victim\n"
    return {"followed_the_planted_symlink": followed, "mode": None if mode is None else oct(mode),
            "ok": mode is not None and not path.is_symlink() and not followed and not mode & 0o077}


# ------------------------------------------------------------ pool files
def _small_pools() -> list:
    """The saved pools of a kvcmas estimator holding one slot's anchors of head_dim 8 (another model's shapes)."""
    from sglang_kvshare.correction import RopeSpec, SegmentCache, make_estimator
    from sglang_kvshare.correction.pool_file import save_pools

    g = torch.Generator().manual_seed(0)
    est = make_estimator("kvcmas", RopeSpec.default(head_dim=8), tau=1.0, rank=4, min_edge_anchors=2)
    seg = lambda: (torch.randn(3, 12, 2, 8, generator=g), torch.randn(3, 12, 2, 8, generator=g))  # noqa: E731
    for c in range(2):
        k, v = seg()
        tk, tv = seg()
        est.observe(((None, None, None), "doc"), SegmentCache(k, v, 3, "a"), SegmentCache(tk, tv, 7, "b"),
                    content_key=f"doc{c}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "small.pt"
        save_pools(path, est, secret=secrets.token_bytes(16), identity={}, rank={})
        return torch.load(path, weights_only=True)["pools"]


def pool_cases(saved: Path) -> dict[str, Callable[[Path], None]]:
    """Writers of hostile pool files made from ``saved``, a pool file the server itself wrote (so its model
    identity is exactly what the server checks): another architecture, other weights, anchors of other shapes
    under the server's own identity, a version of the wrong type, bytes that are no pool file."""
    def edit(change: Callable[[dict], dict]) -> Callable[[Path], None]:
        return lambda path: torch.save(change(torch.load(saved, weights_only=True)), path)

    return {
        "wrong_shapes": edit(lambda p: {**p, "pools": _small_pools()}),
        "other_architecture": edit(lambda p: {**p, "model": {**p["model"], "architecture": "0" * 32}}),
        "other_weights": edit(lambda p: {**p, "model": {**p["model"], "weights": "path:" + "x" * 8}}),
        "version_true": edit(lambda p: {**p, "version": True}),
        "not_a_pool_file": lambda path: path.write_bytes(b"\x80\x02not a pool file"),
    }


def launch_refused(model_path: str, pool_file: Path, timeout: float = 300.0) -> dict:
    """A real kvcmas launch with ``pool_file``: ``refused`` when the process exits with an error before it
    answers, with the last line of its log that names the file as the message (a server that comes up is
    stopped: the file was accepted)."""
    from devtools.server_process import ServerProcess

    server = ServerProcess(model_path=model_path, kvshare_args=("--kvshare-mode", "kvcmas", "--kvshare-pool-file",
                                                                str(pool_file))).launch()
    deadline, up = time.monotonic() + timeout, False
    try:
        while server.proc.poll() is None and time.monotonic() < deadline and not up:
            time.sleep(1.0)
            try:
                up = requests.get(server.url + "/health", timeout=5).status_code == 200
            except requests.RequestException:
                pass
        code = server.proc.poll()
        log = server.log_text()
    finally:
        server.stop()
    named = [ln.strip() for ln in log.splitlines() if pool_file.name in ln]
    errors = [ln for ln in named if "Error" in ln] or named or log.strip().splitlines()[-1:]
    return {"refused": code not in (None, 0) and not up, "crashed": None, "came_up": up,
            "message": (errors[-1] if errors else "")[-400:]}


def hostile_files(folder: Path, model_path: str, saved_pool: Optional[Path] = None,
                  pool_names: Optional[tuple[str, ...]] = None) -> dict:
    """Every hostile guard file handed to the launcher's check, a guard file written beside a planted symlink,
    and (given ``saved_pool``, a pool file the server wrote) the hostile pool files of ``pool_names`` (None: all)
    each launched for real. Returns ``{"passed", "guard": {case: ...}, "guard_write": ..., "pool": {case: ...}}``,
    each case with ``ok``: refused with a message naming the file."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict = {"guard": {}, "pool": {}}
    for name, text in GUARD_CASES.items():
        path = folder / f"guard-{name}.json"
        path.write_text(text())
        out["guard"][name] = judged(path, launch_check(["--model-path", model_path, "--kvshare-mode", "fullshared",
                                                         "--kvshare-fidelity-file", str(path)]))
    (folder / "write").mkdir(exist_ok=True)
    out["guard_write"] = guard_file_writes(folder / "write")
    if saved_pool is not None:
        for name, write in pool_cases(saved_pool).items():
            if pool_names is None or name in pool_names:
                path = folder / f"pool-{name}.pt"
                write(path)
                out["pool"][name] = judged(path, launch_refused(model_path, path))
    out["passed"] = saved_pool is not None and out["guard_write"]["ok"] and all(
        v["ok"] for group in ("guard", "pool") for v in out[group].values())
    return out


def judged(path: Path, got: dict) -> dict:
    """``got`` (a launch check) with ``ok``: refused, not crashed, and the message names the file."""
    return {**got, "names_the_file": path.name in got["message"],
            "ok": got["refused"] and not got["crashed"] and path.name in got["message"]}
