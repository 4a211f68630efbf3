"""A model named by its Hugging Face Hub id, resolved into the standard cache.

`resolve_model("deepseek-community/Janus-Pro-1B", revision=None)` returns the snapshot folder of
that repository in the Hugging Face cache (`HF_HOME`, default `~/.cache/huggingface`), downloading
it first unless `HF_HUB_OFFLINE=1`; a local folder is returned as it is. What cannot be resolved
(offline with nothing cached, no network, no such repository or revision) is one `UserError`
line naming the `hf download` command that fills the cache.

`resolve_file("FoundationVision/LlamaGen:c2i_XL_384.pt")` does the same for one file of a
repository (official LlamaGen checkpoints, LANTERN drafter files), `REPO:FILE`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from runtime.utils.errors import UserError

# owner/name as the Hub spells it (letters, digits, - _ .), no path separators beyond the one slash
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


# original releases in their own code's layout (remote code), and the repository holding the same
# weights in transformers' layout, which the runtime reads
CONVERTED = {"deepseek-ai/Janus-Pro-1B": "deepseek-community/Janus-Pro-1B",
             "deepseek-ai/Janus-Pro-7B": "deepseek-community/Janus-Pro-7B",
             "deepseek-ai/Janus-1.3B": "deepseek-community/Janus-1.3B",
             "BAAI/Emu3-Gen": "BAAI/Emu3-Gen-hf"}


def looks_like_repo_id(name: str) -> bool:
    """`owner/name` that is not an existing local path."""
    return bool(_REPO_ID.match(name)) and not Path(name).exists()


def _download_hint(repo: str, revision: str | None, file: str | None = None) -> str:
    rev = f" --revision {revision}" if revision else ""
    what = f" {file}" if file else ""
    return f"hf download {repo}{what}{rev}"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """The Hub cache as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub), read per call rather than at huggingface_hub's import."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def check_hub_names(name: str, revision: str | None, flag: str = "--model") -> None:
    """Refuse, in one line, a Hub id the Hub library would not take (`validate_repo_id`: `x/y..z`,
    `a--b/c`, `a/b.git`, `a/b-`) and a revision that is empty or a path (`..`, `/x`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as err:
        reason = str(err).splitlines()[0].rstrip(".")
        raise UserError(f"{flag} {name}: not a Hub id the Hub accepts ({reason}); give owner/name as its Hub page "
                        "spells it, or a local folder") from None
    if revision is not None:
        parts = revision.split("/")
        if not revision.strip() or revision != revision.strip() or any(p in ("", ".", "..") for p in parts):
            raise UserError(f"--model-revision {revision!r}: not a branch, tag or commit (empty, or a path); give "
                            "one such as main, v1.0 or a commit hash")


def resolve_model(name: str, revision: str | None = None, flag: str = "--model") -> str:
    """A local folder as given; a Hub id `owner/name` -> its snapshot folder in the cache."""
    if name in CONVERTED and not Path(name).exists():
        raise UserError(f"--model {name}: that repository holds the original release's layout (remote code); the "
                        f"runtime reads transformers' layout of the same weights: --model {CONVERTED[name]}")
    if not looks_like_repo_id(name):
        if revision is not None:
            raise UserError(f"--model-revision {revision}: {name} is a local folder, not a Hub id; drop "
                            "--model-revision or name the model by its Hub id (owner/name)")
        return name
    check_hub_names(name, revision, flag)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise UserError(f"--model {name}: a Hub id needs huggingface_hub; pip install huggingface_hub") from None
    hint = _download_hint(name, revision)
    try:
        return _confined_snapshot(snapshot_download(name, revision=revision, local_files_only=_offline(),
                                                    cache_dir=cache_dir()), name, revision, hint)
    except LocalEntryNotFoundError:
        if (_repo_cache(name) / "refs" / (revision or "main")).is_file():  # cached, but its ref leads nowhere
            raise _damaged(name, revision, hint) from None
        where = cache_dir()
        why = "HF_HUB_OFFLINE is set" if _offline() else "the Hub could not be reached"
        raise UserError(f"--model {name}{f'@{revision}' if revision else ''}: no such folder here, and not in the "
                        f"Hugging Face cache "
                        f"({where}) and {why}; run `{hint}` where the Hub is reachable (same HF_HOME), then "
                        "retry") from None
    except GatedRepoError:
        raise UserError(f"--model {name}: the repository is gated; accept its terms on huggingface.co, "
                        f"`hf auth login`, then `{hint}`") from None
    except RepositoryNotFoundError:
        raise UserError(f"--model {name}: no such model repository on the Hub (or it is private); check the id "
                        "(`runtime models` lists the families' ids)") from None
    except RevisionNotFoundError:
        raise UserError(f"--model-revision {revision}: {name} has no such revision (branch, tag or commit)") from None
    except OSError as err:  # network failures below huggingface_hub's own errors
        raise UserError(f"--model {name}: could not download ({str(err).splitlines()[0]}); run `{hint}` where "
                        "the Hub is reachable, or set HF_HUB_OFFLINE=1 to use the cache only") from None


def _confined_snapshot(path: str, name: str, revision: str | None, hint: str) -> str:
    """The snapshot folder the cache resolved, refused unless it is a folder directly under the
    repository's `snapshots/` (a `refs/` file holding a path, or nothing, would point elsewhere)."""
    snapshot = Path(path)
    snapshots = _repo_cache(name) / "snapshots"
    inside = os.path.realpath(snapshot.parent) == os.path.realpath(snapshots) and snapshot.name not in ("", ".", "..")
    if not inside or not snapshot.is_dir():
        raise _damaged(name, revision, hint)
    return path


def _repo_cache(name: str) -> Path:
    return Path(cache_dir()) / f"models--{name.replace('/', '--')}"


def _damaged(name: str, revision: str | None, hint: str) -> UserError:
    ref = f"refs/{revision or 'main'}"
    return UserError(f"--model {name}: the cached snapshot is damaged ({ref} names no snapshot folder under "
                     f"{_repo_cache(name) / 'snapshots'}); run `{hint}` again")


def resolve_file(spec: str, revision: str | None = None) -> str:
    """A local file as given; `owner/name:file` -> that file of the repository, from the cache."""
    repo, sep, file = spec.partition(":")
    if not sep or not _REPO_ID.match(repo) or not file or Path(spec).exists():
        return spec
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    hint = _download_hint(repo, revision, file)
    try:
        return hf_hub_download(repo, file, revision=revision, local_files_only=_offline(), cache_dir=cache_dir())
    except LocalEntryNotFoundError:
        raise UserError(f"{spec}: not in the Hugging Face cache and the Hub cannot be used here; run `{hint}` "
                        "first") from None
    except EntryNotFoundError:
        raise UserError(f"{spec}: {repo} has no file {file}; check the file name on its Hub page") from None
    except RepositoryNotFoundError:
        raise UserError(f"{spec}: no such repository on the Hub ({repo})") from None
    except OSError as err:
        raise UserError(f"{spec}: could not download ({str(err).splitlines()[0]}); run `{hint}`") from None
