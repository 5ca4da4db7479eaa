"""What a server offers: :class:`ModelCatalog` (the local store, plus models registered by name such
as ``localllm serve MODEL``'s) and :class:`ModelSource` (one model: its name and its weights).
The pool (:mod:`localllm.serving.pool`) loads what the catalog resolves."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from localllm.errors import InvalidRequestError, ModelNotFoundError
from localllm.serving.planner import read_model_facts

if TYPE_CHECKING:
    from localllm.store.modelfile import ModelDefaults


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model the server can load: the name clients send and where its weights are."""

    name: str
    path: Path
    quant: str | None
    size_bytes: int  # on disk
    pinned: bool = False  # `serve MODEL`'s: never expires, never evicted
    defaults: ModelDefaults | None = field(default=None, hash=False, compare=False)
    """A stored variant's own defaults (``localllm create``): its system prompt, parameters, examples."""


class ModelCatalog:
    """The models a server offers: ``registered`` ones (by their exact name) and, with
    ``include_store``, every model in the local store (by any name that canonicalizes to it)."""

    def __init__(self, registered: list[ModelSource] | None = None, *, include_store: bool = True) -> None:
        self.registered: dict[str, ModelSource] = {s.name: s for s in registered or []}
        self.include_store = include_store
        self._context: dict[tuple[Path, float], int | None] = {}

    def register(self, source: ModelSource) -> None:
        self.registered[source.name] = source

    def sources(self) -> list[ModelSource]:
        """Every model on offer: the registered ones first, then the store's (most recent first)."""
        out = list(self.registered.values())
        if self.include_store:
            from localllm.store import local

            paths = {s.path.resolve() for s in out}
            for m in local.list_models():
                if m.path.resolve() not in paths:
                    out.append(ModelSource(m.name, m.path, m.quant, m.size))
        return out

    def resolve(self, name: str) -> ModelSource:
        """The source a request's ``model`` names; ModelNotFoundError (404) for anything else."""
        source = self.registered.get(name)
        if source is not None:
            return source
        if self.include_store:
            from localllm.store import local

            try:
                if local.is_pulled(name):
                    path = local.path_for(name)
                    for registered in self.registered.values():  # the store's copy of `serve MODEL`'s
                        if registered.path.resolve() == path.resolve():
                            return registered
                    stored = next((m for m in local.list_models() if m.path == path), None)
                    if stored is not None:
                        variant = local.defaults_of(stored.name)
                        return ModelSource(stored.name, stored.path, stored.quant, stored.size,
                                           defaults=variant[1] if variant else None)
            except (InvalidRequestError, OSError):
                pass
        offered = ", ".join(s.name for s in self.sources()[:10]) or "none"
        if self.include_store and _in_catalog(name):
            raise ModelNotFoundError(
                f"The model `{name}` is not pulled yet: run `localllm pull {name}`; this server serves: {offered}.",
                param="model",
                code="model_not_found",
            )
        raise ModelNotFoundError(
            f"The model `{name}` does not exist; this server serves: {offered}.",
            param="model",
            code="model_not_found",
        )

    def context_length(self, source: ModelSource) -> int | None:
        """The model's trained context from its header (cached per file and mtime; None if unreadable)."""
        try:
            key = (source.path, source.path.stat().st_mtime)
        except OSError:
            return None
        if key not in self._context:
            try:
                self._context[key] = read_model_facts(source.path).context_length
            except Exception:  # noqa: BLE001 - a listing never fails for one odd file
                self._context[key] = None
        return self._context[key]


def _in_catalog(name: str) -> bool:
    """Whether ``name`` is a model of the catalog (``models.toml``), pulled or not."""
    from localllm.store.catalog import load_catalog

    try:
        return load_catalog().canonical(name) is not None
    except Exception:  # noqa: BLE001 - an unreadable catalog only loses the hint
        return False
