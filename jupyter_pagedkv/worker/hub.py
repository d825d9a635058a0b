"""A Hugging Face hub id to a local folder, as transformers users expect: downloaded on first use
with the hub's own progress bars, from the local cache afterwards, offline when `HF_HUB_OFFLINE=1`
(or `TRANSFORMERS_OFFLINE=1`) says so, and every failure one line that says what to do.

`snapshot_download` is the one place this package talks to the hub (tests replace it). Only what
loading needs is fetched: the config, the tokenizer files and one weight format (safetensors
when the repo has them, else the PyTorch .bin files), plus the repo's Python files when the user
trusts its remote code.
"""
from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                    RepositoryNotFoundError, RevisionNotFoundError)

CONFIG_AND_TOKENIZER = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                        "vocab.json", "merges.txt", "*.model", "*.tiktoken", "chat_template*"]
SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
PYTORCH_BIN = ["*.bin", "*.bin.index.json"]


class HubError(ValueError):
    """A hub id that cannot be fetched: the message is one line that says what to do."""


def offline() -> bool:
    """The hub's own switches (and transformers'), as both libraries read them."""
    truthy = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def fetch(repo_id: str, revision: str | None = None, trust_remote_code: bool = False) -> Path:
    """The local snapshot folder of `repo_id` at `revision`, downloading what is missing."""
    patterns = CONFIG_AND_TOKENIZER + SAFETENSORS + (["*.py"] if trust_remote_code else [])
    try:
        folder = Path(_download(repo_id, revision, patterns))
        if not any(folder.glob("*.safetensors")):
            # No safetensors in this repo (or revision): fall back to its PyTorch weights.
            folder = Path(_download(repo_id, revision, CONFIG_AND_TOKENIZER + PYTORCH_BIN))
    except GatedRepoError as err:     # before RepositoryNotFoundError: it is a subclass
        raise HubError(f"{repo_id} is gated: accept its licence on its hub page, then log in "
                       f"(`hf auth login`) or set HF_TOKEN") from err
    except RepositoryNotFoundError as err:
        raise HubError(f"{repo_id} is not a model on the hub (or it is private): check the id, or "
                       f"log in (`hf auth login`) if it is yours") from err
    except RevisionNotFoundError as err:
        raise HubError(f"{repo_id} has no revision {revision!r}: use a branch, tag or commit that "
                       f"exists on its hub page") from err
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        if offline():
            raise HubError(f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE / "
                           f"TRANSFORMERS_OFFLINE forbid downloading it: unset them once to download, "
                           f"or pass a local folder") from err
        raise HubError(f"cannot reach the hub to download {repo_id} and it is not in the local cache: "
                       f"check the network, or pass a local folder") from err
    if not (folder / "config.json").is_file():
        raise HubError(f"{repo_id} has no config.json: it is not a transformers model "
                       f"(a GGUF-only repo? download the .gguf file and pass its path)")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise HubError(f"{repo_id} has no safetensors or PyTorch weights at this revision")
    return folder


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    # snapshot_download reads HF_HUB_OFFLINE itself; local_files_only also covers TRANSFORMERS_OFFLINE.
    # Mistral-style repos also ship the same weights as `consolidated.safetensors`: never twice.
    return snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                             ignore_patterns=["consolidated*", "original/*"], local_files_only=offline())
