"""Where the data files shipped in the repository's ``data/`` folder live.

Why one helper: the demo, the workloads, the tests and the benchmarks all read
the GSM8K test split; they all find it here rather than each guessing a
location. The package is installed editable, so the files are found
relative to this source tree: ``<repo>/data/``. A missing file is an error
that names the file; nothing falls back to made-up text.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GSM8K_TEST = DATA_DIR / "gsm8k" / "test.jsonl"


def gsm8k_path() -> Path:
    """The GSM8K test split (``data/gsm8k/test.jsonl``, MIT, see ``data/README.md``).

    Raises ``FileNotFoundError`` when it is absent, e.g. when the package runs from
    an installed wheel instead of a checkout of the repository.
    """
    if not GSM8K_TEST.is_file():
        raise FileNotFoundError(
            f"GSM8K test split not found at {GSM8K_TEST}. It ships in the repository's data/gsm8k/ folder: "
            "run from a checkout of the repository (pip install -e .) or restore data/gsm8k/test.jsonl "
            "(see data/README.md for its source).")
    return GSM8K_TEST
