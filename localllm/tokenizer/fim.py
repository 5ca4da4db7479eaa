"""Fill-in-the-middle: a model's FIM token ids from its GGUF metadata (:class:`FimTokens`) and a
prompt laid out as llama-server lays it out (:func:`format_infill`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A model's fill-in-the-middle token ids (GGUF ``tokenizer.ggml.fim_*_token_id``; older files
    spell the first three ``prefix_token_id``/``suffix_token_id``/``middle_token_id``)."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None  # repository name (repo-level FIM)
    sep: int | None = None  # file separator

    @classmethod
    def from_metadata(cls, metadata: dict) -> FimTokens | None:
        """The FIM ids the metadata declares, or None unless it has all of pre, suf and mid."""

        def get(*names: str) -> int | None:
            for name in names:
                value = metadata.get(f"tokenizer.ggml.{name}_token_id")
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    return value
            return None

        pre, suf, mid = get("fim_pre", "prefix"), get("fim_suf", "suffix"), get("fim_mid", "middle")
        if pre is None or suf is None or mid is None:
            return None
        return cls(pre, suf, mid, get("fim_pad"), get("fim_rep"), get("fim_sep"))


# The chunk separator llama-server puts between extra-context chunks when the model has no FIM_SEP.
_FIM_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


def format_infill(
    fim: FimTokens,
    encode,
    prefix_ids: list[int],
    suffix_ids: list[int],
    prompt_ids: list[int] = (),
    extra: list[tuple[str, str]] = (),
    bos_id: int | None = None,
) -> list[int]:
    """llama-server's ``format_prompt_infill`` (PSM order), without its truncation to a batch:

    ``[extra context] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID``

    ``encode(text)`` tokenizes without special tokens; ``extra`` holds ``(filename, text)`` chunks of
    repo-level context, laid out as ``FIM_REP myproject\n (FIM_SEP filename\n text)* FIM_SEP
    filename\n`` when the model has those tokens (else the chunks joined by a plain separator).
    ``bos_id`` is the BOS to lead with, None when the model adds none.
    """
    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep, *encode("myproject\n")]
    for filename, text in extra:
        if fim.sep is not None:
            extra_ids += [fim.sep, *encode(filename + "\n")]
        else:
            extra_ids += encode(_FIM_CHUNK_SEPARATOR)
        extra_ids += encode(text)
    if fim.sep is not None:
        extra_ids += [fim.sep, *encode("filename\n")]
    head = [bos_id] if bos_id is not None else []
    return [*extra_ids, *head, fim.pre, *prefix_ids, *prompt_ids, fim.suf, *suffix_ids, fim.mid]
