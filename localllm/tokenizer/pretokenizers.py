"""Every pre-tokenizer a GGUF vocabulary can name, keyed by ``tokenizer.ggml.pre``: the one table.

A byte-level BPE vocabulary is split into words by a sequence of regexes before its merges run;
each regex splits every piece the previous one left, keeping both what it matches and what lies
between (``tokenizers``' ``Split(..., "isolated")``). The regexes are llama.cpp's for each name
(``llama-vocab.cpp``), which carry the original Hugging Face tokenizers' pre-tokenizers, with two
kinds of exception: where llama.cpp runs a hand-written splitter in place of the original regex
(GPT-2, Llama 3, Qwen 2, Qwen 3.5, Kimi K2, the digit groupings), the original regex is used, which
that splitter reproduces; and llama.cpp's own spellings of case-insensitive groups are kept, as
they match the same text.

Besides the regexes a name fixes a few flags llama.cpp sets with it: whether decoding cleans up
spaces before punctuation (``clean_spaces``), whether a word found whole in the vocabulary skips
the merges (``ignore_merges``), whether BOS is added by default, whether spaces are written as
``▁`` and the text kept as UTF-8 rather than byte-level (SPM-style BPE), and whether SEP is added.
"""

from __future__ import annotations

from dataclasses import dataclass

# The contractions of the original regexes' (?i:'s|'t|'re|'ve|'m|'ll|'d), spelled out.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's without its last alternative: what llama.cpp's table gives the names that share it.
_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Digits in groups of three counted from the end of the run (1234567 -> 1, 234, 567). llama.cpp's
# splitter ends a piece after each group, so the first group joins the text before it.
_DIGITS_IN_THREES = (r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))", "merged_with_previous")
_LINES = r"[^\n]+|[\n]+"
# Literal characters are written as escapes: an editor's Unicode normalization would change them.
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_YOUTU_CJK = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
    "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
)
_AFMOE_CJK = (
    "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f"
    "\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+"
)
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The original regexes' [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}]: llama.cpp reads every
# letter category as \p{L}, so both are any letter or mark there.
_UPPER = _LOWER = r"[\p{L}\p{M}]"
# llama.cpp's approximation of the mixed-case words of GPT-4o and Tekken: a letter other than
# a-z stands for "upper", a letter other than A-Z for "lower".
_UPPER_APPROX = r"((?=[\p{L}])([^a-z]))"
_LOWER_APPROX = r"((?=[\p{L}])([^A-Z]))"
_FINNISH = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` family splits and decodes text."""

    # Each a regex whose matches become pieces of their own, or (regex, behavior) with a
    # ``tokenizers`` Split behavior such as "merged_with_previous".
    regexes: tuple[str | tuple[str, str], ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool | None = None  # None: the vocabulary type's default
    add_sep: bool = False
    # SPM-style BPE: spaces become U+2581 before the merges, which run on UTF-8 text, and bytes
    # that form no token fall back to <0xXX> tokens.
    escape_whitespaces: bool = False
    byte_encode: bool = True
    # The same splitting as one regex that matches every character: one pass instead of a
    # sequence, and the form tiktoken takes (it drops what its regex does not match), for
    # vocabularies whose merges tiktoken's ranks reproduce exactly (``Vocab.tiktoken_encoding``).
    one_regex: str | None = None
    # Gemma 4's: a word made only of newlines is one token when the vocabulary has it, and BOS
    # is added whatever the file says.
    newline_words_whole: bool = False
    bos_always: bool = False
    has_bos: bool = True  # False: the vocabulary has no BOS, whatever its metadata says


DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]"))
_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True, one_regex=LLAMA3)
# A piece _GPT2_WORDS leaves unmatched is one whitespace character before a visible one, which
# GPT2's last alternative matches alone.
_GPT2 = PreTokenizer((_GPT2_WORDS,), one_regex=GPT2)
_GPT2_WITH_SEP = PreTokenizer((_GPT2_WORDS,), add_sep=True, one_regex=GPT2)
# Digits one by one, then GPT-2's words: as one regex, a run of whitespace before a digit ends its
# piece whole (the sequence's second regex sees the end of a piece there).
_DIGITS_THEN_GPT2 = (r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+")
_STARCODER = PreTokenizer((r"\p{N}", _GPT2_WORDS), one_regex=_DIGITS_THEN_GPT2)
_QWEN2 = PreTokenizer((QWEN2,), clean_spaces=False, one_regex=QWEN2)
_GPT4O_WORDS = (
    r"[^\r\n\p{L}\p{N}]?" + _UPPER_APPROX + "*" + _LOWER_APPROX + "+" + _CONTRACTIONS + "?"
    + r"|[^\r\n\p{L}\p{N}]?" + _UPPER_APPROX + "+" + _LOWER_APPROX + "*" + _CONTRACTIONS + "?"
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_WORDS = (
    r"[^\r\n\p{L}\p{N}]?" + _UPPER_APPROX + "*" + _LOWER_APPROX + "+"
    + r"|[^\r\n\p{L}\p{N}]?" + _UPPER_APPROX + "+" + _LOWER_APPROX + "*"
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Kimi K2's: Han runs on their own, other letters as Llama 3's.
_KIMI_WORDS = (
    r"\p{Han}+|[^\r\n\p{L}\p{N}]?[\p{L}&&[^\p{Han}]]+" + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = PreTokenizer((_GPT4O_WORDS,), clean_spaces=False, one_regex=_GPT4O_WORDS)
_DEEPSEEK3 = PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS), clean_spaces=False)
_CHATGLM4 = PreTokenizer((LLAMA3,), has_bos=False, one_regex=LLAMA3)
_SPM_STYLE = PreTokenizer((_LINES,), escape_whitespaces=True, byte_encode=False)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": DEFAULT,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        _LLAMA3,
    ),
    "minicpm5": PreTokenizer((
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True),
    "deepseek-llm": PreTokenizer((
        "[\r\n]",
        _DEEPSEEK_LETTERS,
        _DEEPSEEK_PUNCTUATION,
        "\\s+$",
        _CJK_DEEPSEEK,
        r"\p{N}+",
    ), clean_spaces=False),
    "deepseek-coder": PreTokenizer(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DEEPSEEK, r"\p{N}"), clean_spaces=False
    ),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    "spark2_5": PreTokenizer((
        r"\p{N}{1,3}",
        _CJK_KANA,
        (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
         r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"),
        r"\p{N}",
    ), clean_spaces=False),
    "youtu": PreTokenizer((
        _YOUTU_CJK,
        r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS + "?"
        + r"|[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS + "?"
        + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), clean_spaces=False, ignore_merges=True),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_WORDS, "[0-9][0-9][0-9]")),
    "mpt": _GPT2,
    "starcoder": _STARCODER,
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
         "modern-bert", "exaone4", "olmo", "jais"),
        _GPT2,
    ),
    **dict.fromkeys(("granite-docling", "trillion"), PreTokenizer((_GPT2_WORDS,), clean_spaces=False, one_regex=GPT2)),
    "jais-2": PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    )),
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m"), PreTokenizer(
        (_LINES,), escape_whitespaces=True, byte_encode=False, newline_words_whole=True, bos_always=True
    )),
    "sarvam-moe": PreTokenizer((_LINES,), escape_whitespaces=True, byte_encode=False, clean_spaces=False),
    **dict.fromkeys(("jina-v1-en", "jina-v2-code", "roberta-bpe"), _GPT2_WITH_SEP),
    "refact": _STARCODER,
    "command-r": PreTokenizer((r"\p{N}", _GPT2_WORDS), clean_spaces=False, one_regex=_DIGITS_THEN_GPT2),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _QWEN2),
    "qwen35": PreTokenizer((QWEN35,), clean_spaces=False, one_regex=QWEN35),
    **dict.fromkeys(("stablelm2", "megrez"), PreTokenizer((QWEN2,), one_regex=QWEN2)),
    "dbrx": PreTokenizer((LLAMA3,), one_regex=LLAMA3),
    "smaug-bpe": PreTokenizer((LLAMA3,), one_regex=LLAMA3),
    "poro-chat": PreTokenizer((_FINNISH,), clean_spaces=False),
    "chatglm-bpe": _CHATGLM4,
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((LLAMA3,), ignore_merges=True, has_bos=False,
                                                   one_regex=LLAMA3)),
    "viking": PreTokenizer((_FINNISH, r"\p{N}"), clean_spaces=False),
    "tekken": PreTokenizer((_TEKKEN_WORDS,), clean_spaces=False, ignore_merges=True, add_bos=True,
                           one_regex=_TEKKEN_WORDS),
    "smollm": PreTokenizer((r"\p{N}", _GPT2_WORDS), clean_spaces=False, one_regex=_DIGITS_THEN_GPT2),
    "codeshell": _STARCODER,
    "bloom": PreTokenizer((_FINNISH,)),
    "gpt3-finnish": PreTokenizer((_FINNISH,)),
    "exaone": _STARCODER,
    "exaone-moe": PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    )),
    "chameleon": PreTokenizer((
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2_WORDS,
    ), clean_spaces=False, add_bos=True),
    "minerva-7b": _STARCODER,
    "mellum2": _STARCODER,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "granite-embed-multi-97m": PreTokenizer((
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
        + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
        + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), clean_spaces=False, ignore_merges=True),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), PreTokenizer((
        _DIGITS_IN_THREES,
        r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS + "?"
        + r"|[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS + "?"
        + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), clean_spaces=False)),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))"), clean_spaces=False),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((
        (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]|\s+(?!\S)|\s+"),
    ), clean_spaces=False)),
    "seed-coder": PreTokenizer((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), clean_spaces=False),
    "hunyuan": _QWEN2,
    "solar-open": _QWEN2,
    "grok-2": _QWEN2,
    "ufakzeka": PreTokenizer((
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), clean_spaces=False),
    "kimi-k2": PreTokenizer((_KIMI_WORDS,), clean_spaces=False, one_regex=_KIMI_WORDS),
    "afmoe": PreTokenizer((
        _DIGITS_IN_THREES,
        _AFMOE_CJK,
        _DEEPSEEK3_WORDS,
    ), clean_spaces=False),
    "laguna": PreTokenizer((_LINES, QWEN2), clean_spaces=False),
}
