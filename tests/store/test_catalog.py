"""The shipped catalog (models.toml): every entry well formed, the families people run, their names."""

from __future__ import annotations

import re

import gguf
import pytest

from localllm import store
from localllm.errors import ModelNotFoundError
from localllm.store import local
from localllm.store.catalog import Catalog

# GGUF quantization names, from the gguf package: file types (Q4_K_M, ...) and tensor types (MXFP4, ...).
GGUF_QUANTS = {n.removeprefix("MOSTLY_") for n in gguf.LlamaFileType.__members__ if n != "GUESSED"} | set(
    gguf.GGMLQuantizationType.__members__
)
REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
FAMILY_RE = re.compile(r"[a-z0-9][a-z0-9.-]*")
TAG_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
SPLIT_GGUF_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def catalog_problems(catalog: Catalog) -> list[str]:
    """Every way an entry of ``catalog`` is malformed, one line each (empty: all well formed)."""
    problems: list[str] = []
    for family, fam in catalog.families.items():
        if not FAMILY_RE.fullmatch(family) or ".." in family:
            problems.append(f"{family}: family name is not lower-case letters, digits, '.' and '-'")
        if catalog.canonical(family) is None:
            problems.append(f"{family}: default_tag {fam.get('default_tag')!r} names no tag")
        for alias, target in fam.get("aliases", {}).items():
            if catalog.canonical(f"{family}:{alias}") != f"{family}:{target}":
                problems.append(f"{family}:{alias}: alias does not resolve to {family}:{target}")
        for tag, entry in fam["tags"].items():
            name = f"{family}:{tag}"
            ref = catalog.ref(name)
            if not TAG_RE.fullmatch(tag):
                problems.append(f"{name}: tag is not lower-case letters, digits, '.', '_' and '-'")
            for key in ("description", "license"):
                if not isinstance(getattr(ref, key), str) or not getattr(ref, key).strip():
                    problems.append(f"{name}: no {key}")
            if not isinstance(ref.context_length, int) or ref.context_length <= 0:
                problems.append(f"{name}: context_length {ref.context_length!r} is not a positive integer")
            repo = str(entry.get("repo", ""))
            if not REPO_ID_RE.fullmatch(repo) or ".." in repo:
                problems.append(f"{name}: repo {repo!r} is not a Hugging Face repo id OWNER/NAME")
            revision = str(entry.get("revision", "main"))
            if revision != "main" and not re.fullmatch(r"[0-9a-f]{40}", revision):
                problems.append(f"{name}: revision {revision!r} is neither main nor a 40-hex commit")
            quant = str(ref.quant or "")
            if not tag.endswith("-" + quant.lower()):
                problems.append(f"{name}: tag does not end in its quant ({quant})")
            if ref.format == "gguf":
                file = str(entry["file"])
                if not file.endswith(".gguf") or SPLIT_GGUF_RE.search(file):
                    problems.append(f"{name}: file {file!r} is not a single .gguf file")
                if quant not in GGUF_QUANTS:
                    problems.append(f"{name}: quant {quant!r} is not a GGUF quantization type")
                elif not re.search(rf"(?i)(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9])", file):
                    problems.append(f"{name}: file {file!r} does not carry its quant {quant}")
            elif not re.fullmatch(r"GPTQ-Int[2348]", quant) or "config.json" not in entry.get("files", ()):
                problems.append(f"{name}: a gptq entry needs quant GPTQ-IntN and config.json among its files")
            for f in ref.files:
                if f.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
                    problems.append(f"{name}: sha256 {f.sha256!r} is not 64 hex digits")
                if f.size is not None and (not isinstance(f.size, int) or f.size <= 0):
                    problems.append(f"{name}: size {f.size!r} is not a positive integer")
    return problems


def test_every_catalog_entry_is_well_formed(env):
    catalog = store.load_catalog()
    assert catalog_problems(catalog) == []
    for name in catalog.names():  # every name the catalog answers to resolves to one of its tags
        ref = store.resolve(name)
        assert ref.kind == "catalog" and ref.name in catalog.canonical_names()
        assert store.canonical_name(name) == ref.name


def test_the_well_formedness_check_finds_each_kind_of_fault():
    broken = Catalog.from_toml('''
[models.bad]
description = "a broken family"
license = "mit"
context_length = 0
default_tag = "1b"
aliases = { "1b" = "1b-q4_k_m" }

[models.bad.tags."1b-q4_k_m"]
quant = "Q4_K_M"
repo = "not a repo"
file = "model-Q4_K_M.bin"

[models.bad.tags."1b-q9_z"]
quant = "Q9_Z"
repo = "o/r"
revision = "v1"
file = "m-Q9_Z.gguf"
sha256 = "ABC"

[models.bad.tags."1b-q8_0"]
quant = "Q8_0"
repo = "o/r"
file = "m-Q4_0.gguf"

[models.bad.tags."2b"]
quant = "Q8_0"
repo = "o/r"
file = "m-Q8_0-00001-of-00002.gguf"
''')
    problems = "\n".join(catalog_problems(broken))
    for expected in [
        "bad:1b-q4_k_m: context_length 0",
        "bad:1b-q4_k_m: repo 'not a repo'",
        "bad:1b-q4_k_m: file 'model-Q4_K_M.bin' is not a single .gguf file",
        "bad:1b-q9_z: quant 'Q9_Z' is not a GGUF quantization type",
        "bad:1b-q9_z: revision 'v1'",
        "bad:1b-q9_z: sha256 'abc'",
        "bad:1b-q8_0: file 'm-Q4_0.gguf' does not carry its quant Q8_0",
        "bad:2b: tag does not end in its quant (Q8_0)",
        "bad:2b: file 'm-Q8_0-00001-of-00002.gguf' is not a single .gguf file",
    ]:
        assert expected in problems, expected


# What `localllm pull NAME` must find, and the tag a bare family name means (as Ollama's library has it).
FAMILIES = {
    "qwen3": ("8b", ["0.6b", "1.7b", "4b", "8b", "30b-a3b"]),
    "qwen3-coder": ("30b-a3b", ["30b-a3b"]),
    "qwen3.5": ("35b-a3b", ["35b-a3b"]),
    "qwen3.6": ("35b-a3b", ["35b-a3b"]),
    "gpt-oss": ("20b", ["20b"]),
    "gemma3": ("4b", ["1b", "4b", "12b"]),
    "phi4-mini": ("3.8b", ["3.8b"]),
    "smollm3": ("3b", ["3b"]),
    "mistral-small3.2": ("24b", ["24b"]),
    "olmoe": ("1b-7b", ["1b-7b"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_catalog_has_the_families_people_run(env, family):
    default, sizes = FAMILIES[family]
    assert store.canonical_name(family) == store.canonical_name(f"{family}:{default}")
    for size in sizes:
        ref = store.resolve(f"{family}:{size}")
        assert ref.kind == "catalog" and ref.format == "gguf" and ref.name.startswith(f"{family}:{size}-")
        src = ref.sources[0]
        assert isinstance(src, store.HubSource) and src.files == (ref.files[0].name,)
        assert ref.quant and ref.quant.lower() in ref.files[0].name.lower()


def test_gpt_oss_is_the_mxfp4_file(env):
    ref = store.resolve("gpt-oss:20b")
    assert ref.quant == "MXFP4" and "mxfp4" in ref.files[0].name.lower()


@pytest.mark.parametrize("name", ["qwen3:30b-a3b", "qwen3.5:35b-a3b", "qwen3.5", "mistral-small3.2:24b",
                                  "gpt-oss:20b", " qwen3.6:35b-a3b-q4_k_m ", "phi4-mini:3.8b"])
def test_family_names_with_dots_and_tags_with_dashes_parse(env, name):
    key = store.canonical_name(name)
    family, _, tag = key.partition(":")
    assert family == name.strip().partition(":")[0] and tag.startswith(name.strip().partition(":")[2])
    assert store.resolve(name).name == key
    directory = local.model_dir(name)
    assert directory.parent == local.models_dir() and directory.name == local.safe_name(key)


def test_an_unknown_size_of_a_known_family_lists_its_tags(env):
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve("qwen3:70b")
    assert "qwen3:30b-a3b" in e.value.message and "qwen3:8b" in e.value.message
    with pytest.raises(ModelNotFoundError) as e:
        store.resolve("qwen3.7")
    assert "qwen3" in e.value.message and "did you mean" in e.value.message
