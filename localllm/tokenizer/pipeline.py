"""What encodes a GGUF vocabulary's plain text, built from its :class:`~localllm.tokenizer.vocab.Vocab`.

* :func:`backend`: a Rust ``tokenizers`` pipeline (regex splits, the byte-level step, a BPE,
  WordPiece or Unigram model) for one fragment of plain text; special tokens, the SPM space prefix
  and UGM's spaces are the encoder's (:mod:`~localllm.tokenizer.encoder`).
* :func:`tiktoken_encoding`: the same ids through tiktoken, where its ranks reproduce the merges
  exactly (checked), which is several times faster.
* :func:`transformers_json`: the pipeline as a complete ``tokenizer.json`` for transformers (special
  tokens as added tokens, a decoder, BOS/EOS as a post-processor): for exports and for libraries
  that take a transformers tokenizer (xgrammar).
"""

from __future__ import annotations

from localllm.tokenizer.pretokenizers import GPT2
from localllm.tokenizer.vocab import Attr, Vocab, as_list


def backend(vocab: Vocab):
    """The ``tokenizers`` pipeline that encodes a fragment of plain text."""
    return _build_backend(vocab, for_transformers=False)


def transformers_json(vocab: Vocab) -> str:
    return _build_backend(vocab, for_transformers=True).to_str()


def tiktoken_encoding(vocab: Vocab):
    """A ``tiktoken`` encoding that gives exactly the vocabulary's BPE ids, or None.

    tiktoken merges the adjacent pair whose joined bytes have the lowest rank; llama.cpp the pair
    with the lowest merge rank, among the pairs in the merges. They agree when the ranks (the ids)
    follow the merges' order and every split of every token into two tokens is one of the merges
    (vocabularies made from tiktoken's, as Llama 3's), and, where llama.cpp would not take a whole
    word found in the vocabulary, when each token's own text merges into that token. Those are
    checked here; the regex is the pre-tokenizer's one-regex form.
    """
    pre = vocab.pre
    if vocab.kind != "bpe" or not pre.byte_encode or pre.one_regex is None:
        return None
    pieces, attrs = vocab.pieces, vocab.attrs
    ranks: dict[bytes, int] = {}
    for i, (piece, attr) in enumerate(zip(pieces, attrs)):
        if attr & Attr.NORMAL:
            if piece in ranks:
                return None
            ranks[piece] = i
    if any(bytes([b]) not in ranks for b in range(256)):
        return None
    index = {t: i for i, t in enumerate(vocab.tokens)}
    pairs = set()
    last = -1
    for left, right in _bpe_merges(vocab, index):
        joined, a, b = index[left + right], index[left], index[right]
        if not attrs[joined] & attrs[a] & attrs[b] & Attr.NORMAL or joined < last:
            return None
        last = joined
        pairs.add((pieces[a], pieces[b]))
    for piece in ranks:
        for cut in range(1, len(piece)):
            left = piece[:cut]
            if left in ranks and piece[cut:] in ranks and (left, piece[cut:]) not in pairs:
                return None
    if not pre.ignore_merges:
        model = backend(vocab).model
        for piece, i in ranks.items():
            if len(piece) > 1 and [t.id for t in model.tokenize(vocab.tokens[i])] != [i]:
                return None
    import tiktoken

    return tiktoken.Encoding(f"gguf-{vocab.pre_name}", pat_str=pre.one_regex, mergeable_ranks=ranks,
                             special_tokens={})


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, implied by the scores: every split of a token into two tokens,
    ranked by the joined token's score (highest first). llama.cpp merges the adjacent pair whose
    join is the best-scored token; a BPE model with these ranks does the same."""
    index = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t, i in index.items():
        if len(t) < 2:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in index and right in index:
                merges.append((-scores[i], i, cut, left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _bpe_merges(vocab: Vocab, index: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges that name tokens of the vocabulary (a ``tokenizers`` BPE model refuses
    others; llama.cpp would merge such a pair into a symbol that then falls back to bytes)."""
    out = []
    append = out.append
    for m in as_list(vocab.merges):
        cut = m.find(" ", 1)
        if cut > 0:
            left, right = m[:cut], m[cut + 1:]
            if left in index and right in index and left + right in index:
                append((left, right))
    return out


def _wpm_token(text: str, attr: int) -> str:
    """A GGUF WordPiece token as the original vocabulary spelled it: llama.cpp's converter writes
    word-initial pieces with a ``▁`` and continuations without their ``##``."""
    if attr & Attr.CUT_OUT or (text.startswith("[") and text.endswith("]")):
        return text
    return text[1:] if text.startswith("\u2581") else "##" + text


def _build_backend(vocab: Vocab, *, for_transformers: bool):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = vocab.tokens
    index = {t: i for i, t in enumerate(tokens)}
    unk = tokens[vocab.ids.unk] if vocab.ids.unk is not None else None
    if vocab.kind == "bpe":
        merges = _bpe_merges(vocab, index)
        model = models.BPE(vocab=index, merges=merges, ignore_merges=vocab.pre.ignore_merges,
                           byte_fallback=not vocab.pre.byte_encode, fuse_unk=False)
        tok = Tokenizer(model)
        pre = vocab.pre
        if pre.one_regex is not None:
            regexes = [] if pre.one_regex == GPT2 and pre.byte_encode else [pre.one_regex]
        else:
            regexes = pre.regexes
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") if isinstance(r, str)
                  else pre_tokenizers.Split(Regex(r[0]), behavior=r[1]) for r in regexes]
        if vocab.pre.byte_encode:
            # GPT-2's regex is the byte-level step's own: one pass does both
            splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not regexes))
            tok.decoder = decoders.ByteLevel()
        else:
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
        if vocab.escape_whitespaces and for_transformers:
            tok.normalizer = normalizers.Replace(" ", "\u2581")
    elif vocab.kind == "spm":
        model = models.BPE(vocab=index, merges=_spm_merges(tokens, as_list(vocab.scores)), byte_fallback=True,
                           unk_token=unk, fuse_unk=False)
        tok = Tokenizer(model)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if vocab.add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
        if for_transformers:
            norm = [normalizers.Prepend("\u2581")] if vocab.add_space_prefix else []
            tok.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", "\u2581")])
    elif vocab.kind == "wpm":
        pieces = {_wpm_token(t, a): i for i, (t, a) in enumerate(zip(tokens, vocab.attrs))}
        model = models.WordPiece(vocab=pieces, unk_token=unk or "[UNK]", max_input_chars_per_word=1 << 30)
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece()
        if for_transformers:
            tok.normalizer = normalizers.BertNormalizer(
                clean_text=True, handle_chinese_chars=True, strip_accents=vocab.normalizer_strip_accents,
                lowercase=vocab.normalizer_lowercase)
            tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    else:  # ugm
        matchable = Attr.NORMAL | Attr.USER_DEFINED | Attr.UNUSED
        scores = [float(s) for s in as_list(vocab.scores)]
        normal = [s for s, a in zip(scores, vocab.attrs) if a & Attr.NORMAL] or [0.0]
        pieces = []
        for i, (t, a, s) in enumerate(zip(tokens, vocab.attrs, scores)):
            if for_transformers or a & matchable:
                pieces.append((t, 0.0 if a & Attr.USER_DEFINED else s))
            else:
                # llama.cpp's lattice never matches control or byte tokens in text: a text that
                # cannot occur keeps the id, a score inside the normal range keeps the unknown score
                pieces.append((f"\U0010fffe{i}\U0010fffe", max(normal)))
        model = models.Unigram(pieces, unk_id=vocab.ids.unk, byte_fallback=False)
        tok = Tokenizer(model)
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
        if for_transformers:
            steps = [normalizers.Precompiled(vocab.precompiled_charsmap)] if vocab.precompiled_charsmap else []
            if vocab.remove_extra_whitespaces:
                steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
            tok.normalizer = normalizers.Sequence(steps)
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                         prepend_scheme="always" if vocab.add_space_prefix else "never")
    if for_transformers:
        tok.post_processor = _post_processor(vocab)
        tok.add_special_tokens([
            AddedToken(t, special=bool(a & Attr.SPECIAL), normalized=False, lstrip=bool(a & Attr.LSTRIP),
                       rstrip=bool(a & Attr.RSTRIP))
            for t, a in zip(tokens, vocab.attrs) if a & Attr.CUT_OUT
        ])
    return tok


def _post_processor(vocab: Vocab):
    """What transformers adds around a text with ``add_special_tokens``: llama.cpp's BOS/EOS (CLS and
    SEP for WordPiece)."""
    from tokenizers import processors

    ids = vocab.ids
    if vocab.kind == "wpm":
        first, last = [ids.bos], [ids.sep]
    else:
        first = [ids.bos] if vocab.add_bos else []
        last = [ids.eos] if vocab.add_eos else []
    first, last = [i for i in first if i is not None], [i for i in last if i is not None]
    if not first and not last:
        return None
    names = [vocab.tokens[i] for i in first], [vocab.tokens[i] for i in last]
    single = [*names[0], "$A:0", *names[1]]
    pair = [*single, "$B:1", *(f"{t}:1" for t in names[1])]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=sorted({(vocab.tokens[i], i) for i in first + last}))
