"""The launcher behind ``python -m sglang_kvshare.launch_server``: SGLang's launcher plus ``--kvshare-*``.

Why a launcher of our own rather than documenting four flags: one command must
turn kvshare on. It accepts every ``sglang.launch_server`` argument, adds the
``--kvshare-*`` options, selects ``--radix-cache-backend kvshare``, hands our
options to the scheduler process through ``SGLANG_KVSHARE_CONFIG`` (JSON of
``KVShareConfig``; spawned processes inherit the environment), and on a
machine without a GPU fills in CPU defaults that are known to work (torch
native attention, float32, thread settings), each overridable by passing the
flag yourself.
"""

from __future__ import annotations

# Stand-ins must exist before SGLang's modules load (see cpu_standins).
from sglang_kvshare.server import cpu_standins

cpu_standins.install()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import typing  # noqa: E402
from typing import Sequence  # noqa: E402

from sglang_kvshare.config import (BACKEND_NAME, GROUP_MAIN, GROUPS, NOT_SETTINGS, KVShareConfig,  # noqa: E402
                                   config_from_file, from_text)
from sglang_kvshare.guard.saved import GuardFile  # noqa: E402

KVSHARE_PREFIX = "--kvshare-"
CONFIG_FLAG = "--kvshare-config"
CONFIG_DEST = "config file"  # not a field name, so it cannot clash with one

# (flag, value or None for a switch) applied on a CPU-only machine unless given.
CPU_DEFAULTS: tuple[tuple[str, str | None], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--sampling-backend", "pytorch"),
    ("--disable-cuda-graph", None),
    ("--skip-server-warmup", None),
    ("--dtype", "float32"),
    ("--mem-fraction-static", "0.8"),  # of system RAM; --max-total-tokens bounds the KV pool
    ("--max-total-tokens", "16384"),
    # NOTE: an idle scheduler otherwise polls at 100 % of a core; on a 2-core machine one
    # idle server halves the speed of another one (measured: both schedulers at 99 % CPU).
    # SGLang's own zmq poll wakes on the next request, so a request waits for nothing.
    ("--sleep-on-idle", None),
)


def _metavar(f: dataclasses.Field) -> str | None:
    kind = str(f.type)
    if kind == "bool":
        return "{true,false}"
    args = typing.get_args(typing.get_type_hints(KVShareConfig)[f.name])
    if args and all(isinstance(a, str) for a in args):  # a Literal: its choices
        return "{" + ",".join(args) + "}"
    return None


def add_kvshare_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--kvshare-config`` and one ``--kvshare-<field>`` option per flag field, grouped by component.

    Defaults are left out of the namespace (``SUPPRESS``): a flag given on the command line wins over the
    config file, which wins over the field's default.
    """
    groups = {}
    for name, description in GROUPS.items():
        if name == GROUP_MAIN or any(f.metadata["group"] == name and f.metadata["flag"]
                                     for f in dataclasses.fields(KVShareConfig)):
            title = "kvshare" if name == GROUP_MAIN else f"kvshare {name}"
            groups[name] = parser.add_argument_group(title, description)
    for f in dataclasses.fields(KVShareConfig):
        if not f.metadata["flag"]:
            continue
        flag = KVSHARE_PREFIX + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        default = str(f.default).lower() if isinstance(f.default, bool) else f.default
        groups[f.metadata["group"]].add_argument(
            flag, dest=f.name, type=functools.partial(from_text, f.name), default=argparse.SUPPRESS,
            metavar=_metavar(f), help=f"{help_text} (default: {default})")
    groups[GROUP_MAIN].add_argument(
        CONFIG_FLAG, dest=CONFIG_DEST, metavar="FILE", default=argparse.SUPPRESS,
        help="A TOML file of kvshare settings: the ones without a flag, in the sections "
             + ", ".join(f"[{g}]" for g in GROUPS if g != GROUP_MAIN)
             + ", and any flag's setting under its key (docs/CONFIGURATION.md lists every key and its section). "
               "An unknown key or a bad value is a launch error; a flag given on the command line wins over "
               "the file.")


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``--kvshare-*`` options (with their values) from SGLang's."""
    ours, theirs = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(KVSHARE_PREFIX):
            ours.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                ours.append(argv[i + 1])
                i += 1
        else:
            theirs.append(arg)
        i += 1
    return ours, theirs


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` (``--flag v`` or ``--flag=v``; the last one wins), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def gpu_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def with_defaults(sglang_argv: Sequence[str], *, cpu: bool, select_backend: bool = True) -> list[str]:
    """SGLang's argv with our backend selected and CPU defaults filled in."""
    argv = list(sglang_argv)
    if select_backend and not _has_flag(argv, "--radix-cache-backend"):
        argv += ["--radix-cache-backend", BACKEND_NAME]
    if cpu:
        for flag, value in CPU_DEFAULTS:
            if not _has_flag(argv, flag):
                argv += [flag] if value is None else [flag, value]
    return argv


def cpu_thread_env(ranks: int = 1) -> dict[str, str]:
    """Without explicit thread settings libgomp spins under load (docs/OPERATIONS.md, "On a machine without a GPU").

    ``ranks``: scheduler processes (dp x tp x pp). SGLang's CPU path wants one
    ``|``-separated bind group per rank and refuses to start a rank without
    one; the cores are split evenly, and with fewer cores than ranks they are
    shared round robin.
    """
    n = os.cpu_count() or 1
    if ranks <= 1:
        return {"OMP_NUM_THREADS": str(n), "SGLANG_CPU_OMP_THREADS_BIND": f"0-{n - 1}", "HF_HUB_OFFLINE": "1"}
    per = max(1, n // ranks)
    groups = []
    for i in range(ranks):
        first = (i * per) % n
        groups.append(str(first) if per == 1 else f"{first}-{first + per - 1}")
    return {"OMP_NUM_THREADS": str(per), "SGLANG_CPU_OMP_THREADS_BIND": "|".join(groups), "HF_HUB_OFFLINE": "1"}


def parallel_ranks(sglang_argv: Sequence[str]) -> int:
    """Scheduler processes the SGLang argv starts: dp x tp x pp (each 1 unless given)."""
    ranks = 1
    for flags in (("--dp-size", "--dp"), ("--tp-size", "--tp"), ("--pp-size", "--pp")):
        values = [v for v in (_flag_value(sglang_argv, f) for f in flags) if v is not None]
        try:
            ranks *= max(1, int(values[-1])) if values else 1
        except ValueError:
            pass  # SGLang's own parser reports the bad value
    return ranks


def apply_cpu_thread_env(ranks: int = 1) -> None:
    for key, value in cpu_thread_env(ranks).items():
        os.environ.setdefault(key, value)


def kvshare_parser() -> argparse.ArgumentParser:
    """The ``--kvshare-*`` options alone (the launcher's ``--help`` shows them first)."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kvshare.launch_server", add_help=False,
        usage="%(prog)s --model-path PATH [--kvshare-mode {off,fullshared,kvcmas}] [--kvshare-* ...] "
              "[sglang.launch_server options ...]",
        description="An SGLang server with the kvshare cache (--radix-cache-backend kvshare). Every "
                    "sglang.launch_server option works here; the kvshare options come first, the ones most "
                    "users set at the top; the settings without a flag are set in a --kvshare-config file. "
                    "Every setting: docs/CONFIGURATION.md.")
    add_kvshare_args(parser)
    return parser


def print_help() -> None:
    """The kvshare options first, grouped, then SGLang's own."""
    from sglang.srt.server_args import ServerArgs

    kvshare_parser().print_help()
    sglang = argparse.ArgumentParser(prog="python -m sglang_kvshare.launch_server", add_help=False,
                                     usage=argparse.SUPPRESS)
    ServerArgs.add_cli_args(sglang)
    print("\nSGLang's options (sglang.launch_server):")
    sglang.print_help()


def parse_kvshare(argv: Sequence[str]) -> tuple[KVShareConfig, list[str]]:
    """The validated config of the ``--kvshare-*`` options (and their config file), and SGLang's argv."""
    ours, theirs = split_argv(argv)
    parser = kvshare_parser()
    for arg in ours:
        name = arg[len(KVSHARE_PREFIX):].split("=", 1)[0].replace("-", "_")
        if arg.startswith(KVSHARE_PREFIX) and name in NOT_SETTINGS:
            parser.error(f"{arg.split('=', 1)[0]}: {NOT_SETTINGS[name]}")
    given = vars(parser.parse_args(ours))
    path = given.pop(CONFIG_DEST, None)
    try:
        config = config_from_file(path, **given) if path is not None else KVShareConfig(**given)
        if config.fidelity_file:  # a file the guard cannot use stops the launch here, before SGLang starts
            GuardFile.open(config.fidelity_file)
        return config, theirs
    except ValueError as exc:  # ConfigError and GuardFileError included
        parser.error(str(exc))
        raise


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from sglang.srt.plugins import load_plugins

    if "-h" in argv or "--help" in argv:
        load_plugins()  # registers the kvshare backend, so SGLang's --help lists it
        print_help()
        return
    config, sglang_argv = parse_kvshare(argv)
    backend = _flag_value(sglang_argv, "--radix-cache-backend")
    if backend not in (None, BACKEND_NAME):
        raise SystemExit(f"--radix-cache-backend {backend}: this launcher serves the kvshare backend only; "
                         "run python -m sglang.launch_server for other backends.")
    cpu = not gpu_visible()
    if cpu:
        apply_cpu_thread_env(parallel_ranks(sglang_argv))
    sglang_argv = with_defaults(sglang_argv, cpu=cpu)
    # NOTE: exported before the plugins load: the plugin installs its HTTP hooks only in a
    # process that starts a kvshare server, and the scheduler reads its config from here.
    config.export_env()
    load_plugins()

    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
