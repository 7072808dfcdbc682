"""Where a model comes from: one resolver for every way of naming a model.

A *model spec* is the string given as `--target` / `--draft`, `LocalEngine(target=...)` or
`TargetConfig.model`. It names one of three *sources*:

- a Hugging Face checkpoint directory: `config.json`, `*.safetensors`, tokenizer files optional;
- a `.gguf` file (llama.cpp's format): hyper-parameters, tokenizer and weights in one file, the
  weights possibly quantized (kept as codes or dequantized as they load: specdec.model.gguf_file);
- a Hugging Face Hub id, `owner/name` or `owner/name@revision`, looked up in the local Hub cache
  ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub) and never downloaded: its
  snapshot is a checkpoint directory (or holds a single .gguf file).

`resolve_model_source(spec)` tells them apart (an existing directory; a path ending in .gguf;
something shaped like owner/name[@revision] that is no existing path) and returns a `ModelSource`,
which gives the runtime what it needs in one vocabulary whatever the source: the config as
`config.json` fields, the tensors by Hugging Face name, the tokenizer and the chat template.
Everything that loads a model or a tokenizer goes through it.
"""
from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.\-/]+))?$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
ACCEPTED_FORMS = ("a Hugging Face checkpoint directory (config.json + *.safetensors), a .gguf file, "
                  "or a Hugging Face Hub id in the local cache (owner/name or owner/name@revision)")


class ModelSourceError(ValueError):
    """A model spec that names no loadable model; the message says why and what would do."""


class ModelSource(ABC):
    """A resolved model spec. `path` is the checkpoint directory or the .gguf file it came to."""

    kind: str  # "directory" or "gguf"

    def __init__(self, spec: str, path: Path, hub_id: str | None = None):
        self.spec = spec
        self.path = path
        self.hub_id = hub_id  # the Hub repository it was found under, when the spec is a Hub id

    @cached_property
    def config(self) -> dict:
        """The model's hyper-parameters as Hugging Face `config.json` fields (read once)."""
        return self._read_config()

    @abstractmethod
    def _read_config(self) -> dict: ...

    @abstractmethod
    def tensors(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                keep_quantized: bool = False) -> dict[str, torch.Tensor]:
        """Every weight by its Hugging Face name ([out, in] matrices), as `dtype` on `device`;
        keep_quantized: a quantized matrix as its codes (model.quantized.QuantizedMatrix)."""

    @abstractmethod
    def tokenizer(self):
        """A transformers tokenizer, its `chat_template` set when the source has one, or None when
        the source has no tokenizer (prompts must then be token ids)."""

    @property
    @abstractmethod
    def chat_template(self) -> str | None:
        """The Jinja chat template the source ships, or None."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r} -> {str(self.path)!r})"


class CheckpointDirectory(ModelSource):
    """A Hugging Face checkpoint directory (also what a Hub id resolves to)."""

    kind = "directory"

    def __init__(self, spec: str, path: Path, hub_id: str | None = None):
        super().__init__(spec, path, hub_id)
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"no config.json in {path}: expected a Hugging Face checkpoint directory "
                                   "(config.json + *.safetensors)")
        if not any(path.glob("*.safetensors")):
            raise ModelSourceError(f"no *.safetensors weights in {path}")

    def _read_config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def tensors(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                keep_quantized: bool = False) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}  # safetensors checkpoints hold floats
        for file in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        return tensors

    def tokenizer(self):
        if not any((self.path / name).exists() for name in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer  # deferred: heavy (~0.6 s), and only tokenizers need it

        return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)

    @property
    def chat_template(self) -> str | None:
        """From chat_template.jinja or tokenizer_config.json, as transformers reads it."""
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        config = self.path / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
            return template if isinstance(template, str) else None
        return None


class GGUFFile(ModelSource):
    """One .gguf file: config, tokenizer and (possibly quantized) weights from its metadata and tensors."""

    kind = "gguf"

    def __init__(self, spec: str, path: Path, hub_id: str | None = None):
        super().__init__(spec, path, hub_id)
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {path} does not exist")

    @cached_property
    def _file(self):
        # Deferred: it loads the gguf package (~35 ms), which only .gguf files need.
        from specdec.model.gguf_file import GGUFModelFile

        try:
            return GGUFModelFile(self.path)
        except (OSError, ValueError) as e:  # not a GGUF file, or one of an architecture not supported
            raise ModelSourceError(f"cannot read {self.path} as GGUF: {e}") from e

    def _read_config(self) -> dict:
        return self._file.config()

    def tensors(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                keep_quantized: bool = False) -> dict[str, torch.Tensor]:
        return self._file.tensors(dtype, device, keep_quantized)

    def tokenizer(self):
        return self._file.tokenizer()

    @property
    def chat_template(self) -> str | None:
        return self._file.chat_template


def hub_cache_dir() -> Path:
    """The Hub cache huggingface_hub would use, read from the environment now (not at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot directory of a Hub repository; never touches the network."""
    # Deferred: only Hub ids need huggingface_hub (its errors module alone takes ~25 ms to load).
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    name = repo_id + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as e:
        raise ModelSourceError(
            f"{name!r} is not an existing directory or .gguf file, and as a Hugging Face Hub id it is not in "
            f"the local Hugging Face cache ({cache}); specdec never downloads. On a machine with network run "
            f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}` (or `huggingface-cli "
            f"download {repo_id}`) and copy its cache here, or point HF_HUB_CACHE (or HF_HOME) at a cache "
            f"that holds it, or pass a checkpoint directory or .gguf file instead") from e


def _hub_source(spec: str, repo_id: str, revision: str | None) -> ModelSource:
    snapshot = hub_snapshot(repo_id, revision)
    if (snapshot / "config.json").is_file():
        return CheckpointDirectory(spec, snapshot, repo_id)
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFFile(spec, ggufs[0], repo_id)
    if ggufs:
        raise ModelSourceError(f"Hub snapshot {snapshot} of {spec!r} holds several .gguf files "
                               f"({', '.join(p.name for p in ggufs)}): pass the path of the one to load")
    raise ModelSourceError(f"Hub snapshot {snapshot} of {spec!r} has no config.json and no .gguf file")


def resolve_model_source(spec: str | Path) -> ModelSource:
    """The source a model spec names; ModelSourceError (a ValueError) when it names none."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return CheckpointDirectory(text, path)
    if path.suffix.lower() == ".gguf":
        return GGUFFile(text, path)
    match = HUB_ID.match(text)
    if match and not path.exists() and not text.startswith((".", "~")):
        return _hub_source(text, match["repo"], match["revision"])
    what = "is a file, not" if path.exists() else "names nothing that exists, and is not"
    raise ModelSourceError(f"model {text!r} {what} one of the accepted forms: {ACCEPTED_FORMS}")
