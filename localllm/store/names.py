"""Model names: what each form means, its store key, and the :class:`ModelRef` it resolves to.

A model name is one of (checked in this order):

* ``https://host/path/model.gguf`` (optionally ``#sha256=<hex>``): a plain download;
* a catalog name ``FAMILY[:TAG]`` from ``models.toml`` (``smollm2``, ``smollm2:135m``,
  ``smollm2:135m-q4_1``);
* an existing local file or directory: used where it is, never copied;
* ``hf.co/OWNER/REPO[:QUANT]``: the GGUF file in that Hugging Face repo whose name carries
  the quant (Q4_K_M when no quant is given);
* ``OWNER/REPO/FILE.gguf`` (or ``hf.co/OWNER/REPO/FILE.gguf``): one file of a Hub repo.

:func:`canonical_name` never touches the network; :func:`resolve` does only for
``hf.co/OWNER/REPO[:QUANT]`` (to list the repo's files).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

from localllm.errors import InvalidRequestError, ModelNotFoundError
from localllm.store.catalog import Catalog, load_catalog
from localllm.store.refs import (
    SHA256_RE,
    DownloadError,
    HubSource,
    ModelFile,
    ModelRef,
    UrlSource,
    check_file_name,
    hf_endpoint,
    one_line,
)

DEFAULT_QUANT = "Q4_K_M"
# Order in which a quant is picked from an hf.co repo when the name gives none.
_QUANT_PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16")

_QUANT_RE = re.compile(r"(?i)(?<![a-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=\.gguf$|[-.])")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_HF_PREFIXES = ("hf.co/", "huggingface.co/")


def is_url(name: str) -> bool:
    """An ``http(s)://`` name: a plain download."""
    return name.startswith(("https://", "http://"))


def _check_chars(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError("model name is empty", param="model")
    name = name.strip()
    if "\x00" in name:
        raise InvalidRequestError("model name contains a NUL byte", param="model")
    if "\\" in name:
        raise InvalidRequestError(f"model name {name!r} contains a backslash", param="model")
    return name


def existing_path(name: str) -> Path | None:
    """The local file or directory a name points at, or None."""
    try:
        p = Path(name).expanduser()
        return p if p.exists() else None
    except (OSError, ValueError, RuntimeError):
        return None


def _reject_escapes(name: str) -> None:
    """A name that is not an existing path must not look like one that leaves the store."""
    if name.startswith(("/", "~", "./")) or re.match(r"^[A-Za-z]:/", name):
        raise InvalidRequestError(
            f"no such model file: {name!r} (a path must be an existing file or directory)", param="model"
        )
    if ".." in name.split("/") or ".." in name.split(":"):
        raise InvalidRequestError(f"model name {name!r} contains '..'", param="model")


def _strip_hf_prefix(name: str) -> str | None:
    for prefix in _HF_PREFIXES:
        if name.lower().startswith(prefix):
            return name[len(prefix) :]
    return None


def _split_hf(rest: str) -> tuple[str, str | None, str | None]:
    """``OWNER/REPO[:QUANT]`` or ``OWNER/REPO/PATH.gguf`` -> (repo, quant, file)."""
    parts = rest.split("/")
    if len(parts) >= 3:
        if not parts[-1].lower().endswith(".gguf"):
            raise InvalidRequestError(f"hf.co/{rest}: only .gguf files can be pulled by path", param="model")
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        quant = None
    else:
        repo_q, _, quant_part = rest.partition(":")
        repo, file, quant = repo_q, None, (quant_part or None)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo) or ".." in repo:
        raise InvalidRequestError(f"{rest!r} is not a Hugging Face repo id (OWNER/REPO)", param="model")
    if quant is not None and not re.fullmatch(r"[\w.-]+", quant):
        raise InvalidRequestError(f"bad quant {quant!r} in {rest!r}", param="model")
    return repo, quant, file


def canonical_name(name: str) -> str:
    """The store key for a name, without touching the network.

    Catalog names map to ``family:full-tag``; ``hf.co/owner/repo:q4_k_m`` keeps its repo and
    upper-cases the quant; URLs, Hub file paths and local paths are kept as given.
    Raises :class:`InvalidRequestError` for names that try to escape the store.
    """
    name = _check_chars(name)
    if is_url(name):
        return name
    catalog_key = load_catalog().canonical(name)
    if catalog_key is not None:
        return catalog_key
    local = existing_path(name)
    if local is not None:
        return str(local)
    _reject_escapes(name)
    rest = _strip_hf_prefix(name)
    if rest is not None:
        repo, quant, file = _split_hf(rest)
        if file is not None:
            return f"{repo}/{file}"
        return f"hf.co/{repo}" + (f":{quant.upper()}" if quant else "")
    return name


def resolve(name: str) -> ModelRef:
    """Resolve a model name (see the module docstring) to a :class:`ModelRef`.

    Only ``hf.co/OWNER/REPO[:QUANT]`` needs the network (to list the repo's files).
    Raises :class:`ModelNotFoundError` (with the nearest catalog names) for unknown names and
    :class:`InvalidRequestError` for names that try to escape the store.
    """
    name = _check_chars(name)
    if is_url(name):
        return _resolve_url(name)
    catalog = load_catalog()
    catalog_key = catalog.canonical(name)
    if catalog_key is not None:
        return catalog.ref(catalog_key)
    local = existing_path(name)
    if local is not None:
        return ModelRef(
            name=str(local),
            kind="local",
            format="gguf" if local.is_file() else "gptq",
            quant=_quant_from_filename(local.name) if local.is_file() else None,
            path=local,
        )
    _reject_escapes(name)
    rest = _strip_hf_prefix(name)
    if rest is not None:
        repo, quant, file = _split_hf(rest)
        if file is not None:
            return _hub_file_ref(repo, file)
        return _resolve_hf_repo(repo, quant, canonical_name(name))
    if name.count("/") >= 2 and name.lower().endswith(".gguf"):
        repo, _, file = _split_hf(name)
        return _hub_file_ref(repo, file or "")
    raise ModelNotFoundError(unknown_name_message(name, catalog), param="model", code="model_not_found")


def unknown_name_message(name: str, catalog: Catalog) -> str:
    """Why a name is unknown, with the nearest catalog names (or the tags of its family)."""
    family, sep, tag = name.partition(":")
    if sep and family in catalog.families:
        fam = catalog.families[family]
        tags = sorted({*fam.get("aliases", {}), *fam["tags"]})
        return f"unknown tag {tag!r} for {family}; available: " + ", ".join(f"{family}:{t}" for t in tags)
    families = list(catalog.families)
    close = difflib.get_close_matches(name.lower(), catalog.names(), n=3, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(family.lower(), families, n=3, cutoff=0.5)
    if not close:
        close = [f for f in families if family and (family.lower() in f or f in family.lower())][:3]
    msg = f"model {name!r} not found"
    if close:
        msg += "; did you mean " + ", ".join(close) + "?"
    else:
        msg += "; known models: " + ", ".join(families)
    if name.count("/") == 1:
        msg += f" (for a Hugging Face repo, use hf.co/{name})"
    return msg


def _hub_file_ref(repo: str, file: str) -> ModelRef:
    basename = check_file_name(PurePosixPath(file).name)
    return ModelRef(
        name=f"{repo}/{file}",
        kind="hf",
        files=(ModelFile(basename),),
        sources=(HubSource(repo=repo, files=(file,)),),
        quant=_quant_from_filename(basename),
    )


def _resolve_url(url: str) -> ModelRef:
    parts = urlsplit(url)
    if not parts.hostname:
        raise InvalidRequestError(f"bad URL {url!r}", param="model")
    basename = unquote(PurePosixPath(parts.path).name)
    if not basename.lower().endswith(".gguf"):
        raise InvalidRequestError(f"only .gguf files can be pulled by URL, got {url!r}", param="model")
    sha = None
    if parts.fragment.startswith("sha256="):
        sha = parts.fragment[len("sha256=") :].lower()
        if not SHA256_RE.fullmatch(sha):
            raise InvalidRequestError(f"bad sha256 in URL fragment: {parts.fragment!r}", param="model")
    return ModelRef(
        name=url,
        kind="url",
        files=(ModelFile(check_file_name(basename), sha256=sha),),
        sources=(UrlSource(url=url.split("#", 1)[0]),),
        quant=_quant_from_filename(basename),
    )


def _quant_from_filename(filename: str) -> str | None:
    matches = _QUANT_RE.findall(filename)
    return matches[-1].upper() if matches else None


def pick_gguf(filenames: list[str], quant: str | None) -> str | None:
    """The GGUF file for a quant (case-insensitive, whole-token match preferred), or None."""
    ggufs = [f for f in filenames if f.lower().endswith(".gguf") and not _SPLIT_RE.search(f)]
    if not ggufs:
        return None
    if quant is None:
        for q in _QUANT_PREFERENCE:
            hit = pick_gguf(ggufs, q)
            if hit:
                return hit
        return sorted(ggufs, key=lambda f: (len(f), f))[0] if len(ggufs) == 1 else None
    token = re.compile(rf"(?i)(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9_])")
    hits = [f for f in ggufs if token.search(PurePosixPath(f).name)]
    if not hits:
        hits = [f for f in ggufs if quant.lower() in PurePosixPath(f).name.lower()]
    return sorted(hits, key=lambda f: (len(f), f))[0] if hits else None


def _check_reachable(url: str) -> None:
    """One HEAD: a hub that refuses connections or answers 5xx fails now, in one round trip, not
    after ``list_repo_tree``'s retries with backoff (six tries, ~25 s, on a 503)."""
    import httpx

    try:
        with httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0)) as client:
            status = client.head(url).status_code
    except httpx.TransportError as e:
        raise DownloadError(f"cannot reach {url}: {one_line(e)}") from e
    if status >= 500:
        raise DownloadError(f"cannot reach {url}: it answered HTTP {status}")


def _resolve_hf_repo(repo: str, quant: str | None, canonical: str) -> ModelRef:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    endpoint = hf_endpoint()
    where = endpoint or "https://huggingface.co"
    _check_reachable(where)  # fail at once, not after list_repo_tree's backoff
    try:
        entries = list(HfApi(endpoint=endpoint).list_repo_tree(repo, recursive=True))
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelNotFoundError(f"no repo hf.co/{repo} on the Hugging Face Hub", param="model") from e
    except Exception as e:  # hub error: say which endpoint
        raise DownloadError(f"cannot list hf.co/{repo} on {where}: {one_line(e)}") from e
    files = {e.path: e for e in entries if hasattr(e, "size") and hasattr(e, "lfs")}
    chosen = pick_gguf(list(files), quant)
    if chosen is None and quant is None and (ref := _safetensors_repo_ref(repo, files, canonical)) is not None:
        return ref
    if chosen is None:
        available = sorted({q for f in files if (q := _quant_from_filename(PurePosixPath(f).name))})
        what = f"quant {quant}" if quant else "a default quant (Q4_K_M)"
        hint = f"; available: {', '.join(available)}" if available else "; the repo has no .gguf files"
        raise ModelNotFoundError(f"hf.co/{repo} has no GGUF file for {what}{hint}", param="model")
    entry = files[chosen]
    lfs = getattr(entry, "lfs", None)
    basename = check_file_name(PurePosixPath(chosen).name)
    return ModelRef(
        name=canonical,
        kind="hf",
        files=(ModelFile(basename, size=entry.size, sha256=(lfs.sha256.lower() if lfs else None)),),
        sources=(HubSource(repo=repo, files=(chosen,)),),
        quant=(quant.upper() if quant else _quant_from_filename(basename)),
    )


# The files of a Hugging Face safetensors model (GPTQ or float) that loading needs.
_HF_MODEL_FILE_RE = re.compile(
    r"[^/]+\.safetensors|model\.safetensors\.index\.json|(generation_|quantize_)?config\.json|"
    r"tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|"
    r"tokenizer\.model|chat_template\.(jinja|json)"
)


def _safetensors_repo_ref(repo: str, files: dict[str, Any], canonical: str) -> ModelRef | None:
    """A repo without GGUF files but with ``config.json`` and safetensors weights (a GPTQ or
    float checkpoint): only the files a model needs, from the top level; None otherwise."""
    wanted = sorted(f for f in files if _HF_MODEL_FILE_RE.fullmatch(f))
    if "config.json" not in wanted or not any(f.endswith(".safetensors") for f in wanted):
        return None
    model_files = tuple(
        ModelFile(
            check_file_name(f),
            size=files[f].size,
            sha256=files[f].lfs.sha256.lower() if getattr(files[f], "lfs", None) else None,
        )
        for f in wanted
    )
    return ModelRef(name=canonical, kind="hf", format="gptq", files=model_files,
                    sources=(HubSource(repo=repo, files=tuple(wanted)),))
