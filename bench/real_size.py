"""localllm beside llama.cpp on synthetic models of real sizes (random weights, SmolLM2's vocabulary).

    python bench/real_size.py [--shapes 1b[,3b|,tiny]] [--types Q4_K_M,Q4_0|all] [--threads N]
        [--rounds 2] [--reps 2] [--clients 16,32] [--context 4096 [--kv-types f16,q8_0]] [--work-dir DIR]
        [--write-docs]

Outside CI. For each shape it writes an F16 GGUF of that architecture (``llama``: Llama-3.2-1B's or
-3B's dimensions, tied embeddings, the tokenizer and chat template copied from
``SmolLM2-135M-Instruct.Q4_1.gguf``, weights drawn from a seeded normal with std 0.02, norms 1.0)
and quantizes it with llama.cpp's ``llama-quantize`` to each of ``--types``; the files are cached
in ``--work-dir`` (default ``~/.cache/localllm-real-size``). llama.cpp is the build of
``bench/peer_llamacpp.py`` (built there on first use).

Measured on this machine, per file, alternating the two programs' order each round (best of
``--rounds``):

* decode tokens/s over 64 tokens: localllm streams 65 tokens after a short chat prompt
  (``ignore_eos``) and times the last 64; llama.cpp is ``llama-bench``'s ``tg64``;
* prefill tokens/s of a fresh 512-token prompt (``enable_prefix_caching=False``) against ``pp512``;
* prefill once more with ``LOCALLLM_CPU_ACTIVATIONS=int8x2`` (two activation passes, the
  float32 reference's precision, still batch-invariant), what the default's one pass saves;
* the memory read bandwidth (the native kernels' streaming read of 2 GiB on all threads, best of 5,
  from 4 KiB pages and from huge pages, the faster taken; torch summing float32 where they do not
  build) at the start, and again (1 GiB in huge pages, best of 3) just before and just after every
  decode (localllm: each repetition's, inside its own process; llama.cpp: around each ``llama-bench``
  run, in fresh processes); and the decode bound that the higher of the two reads around each
  program's best decode sets: bandwidth / the bytes a decode step reads (the higher read, so that a
  slow read after a fast decode cannot inflate the share: this host's read speed moves from minute
  to minute, and one read after the round gave shares of 112-138%). Those bytes are localllm's
  weights as its CPU kernels hold them (``backend.held_bytes``: every repacked linear and the tied
  embedding as LM head; a view of the file counts too), which decode reads whole for every token;
  the KV cache read at this short context is left out;
* localllm's resident memory: RSS growth of the process for load + run, KV cache excluded,
  against the file size.

``--clients`` adds concurrent streaming clients (``localllm serve`` against ``llama-server -np
N``), ``--context`` decode tokens/s after a prompt of that many tokens (``llama-bench -d``), for each
of ``--kv-types`` (``-ctk``/``-ctv``), both for the Q4_K_M file of the first shape only. ``--write-docs`` puts the tables in docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section
from cpu_peak import Peak, int8_peak
from cpu_peak import measure as measure_peaks
from peer_llamacpp import (
    PEER_PACKAGE,
    PEER_VERSION,
    build_peer,
    cpu_name,
    llama_bench,
    localllm_env,
    run_llama_server,
    run_localllm_server,
    write_imatrix,
)

TOKENIZER_SOURCE = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TYPES = "Q4_K_M,Q4_0"
ALL_TYPES = "Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K,F16,BF16"
SEED = 1234
STD = 0.02
GEN_TOKENS = 64
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    arch: str = "llama"
    experts: int = 0  # a mixture of experts in every layer: this many experts of expert_ffn ...
    experts_used: int = 0  # ... of which a token goes through this many
    expert_ffn: int = 0
    qk_norm: bool = False
    sliding_window: int = 0  # gpt-oss: every other layer attends within this many tokens (and has sinks,
    # biases, an untied head, the post-attention norm before its experts and YaRN over 4096 positions)

    @property
    def active_share(self) -> float:
        """The share of the expert weights one token reads (1 for a dense model)."""
        return self.experts_used / self.experts if self.experts else 1.0


SHAPES = {
    "tiny": Shape(hidden=256, layers=2, ffn=1024, heads=4, kv_heads=2, head_dim=64),
    "1b": Shape(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, head_dim=64),  # Llama-3.2-1B
    "3b": Shape(hidden=3072, layers=28, ffn=8192, heads=24, kv_heads=8, head_dim=128),  # Llama-3.2-3B
    # Qwen3-30B-A3B's layer (128 experts, top-8, expert FFN 768, 32/4 heads of 128, Q/K norms), 4 of its 48 layers
    "qwen3moe": Shape(hidden=2048, layers=4, ffn=6144, heads=32, kv_heads=4, head_dim=128, rope_theta=1e6,
                      rms_eps=1e-6, arch="qwen3moe", experts=128, experts_used=8, expert_ffn=768, qk_norm=True),
    # gpt-oss-20b's layer (32 experts, top-4, expert FFN 2880, 64/8 heads of 64, sinks, alternating
    # 128-token windows), 4 of its 24 layers; its experts in MXFP4 with llama-quantize's MXFP4_MOE
    "gpt-oss": Shape(hidden=2880, layers=4, ffn=2880, heads=64, kv_heads=8, head_dim=64, context=131072,
                     rope_theta=150000.0, arch="gpt-oss", experts=32, experts_used=4, expert_ffn=2880,
                     sliding_window=128),
}


# ---------------------------------------------------------------------------------------------
# Making the models


def tokenizer_fields(source: Path) -> list[tuple[str, object, object, object]]:
    """``(key, value, type, sub_type)`` of ``source``'s tokenizer.* keys (vocabulary, merges,
    special ids, chat template)."""
    from gguf import GGUFReader, GGUFValueType

    fields = []
    for key, f in GGUFReader(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        fields.append((key, f.contents(), vtype, sub))
    return fields


def tensor_shapes(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """llama.cpp's tensor names and numpy shapes (rows, cols) for shape ``s``, in file order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    oss = s.arch == "gpt-oss"
    out = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (q, s.hidden)),
                (b + "attn_k.weight", (kv, s.hidden)), (b + "attn_v.weight", (kv, s.hidden)),
                (b + "attn_output.weight", (s.hidden, q)),
                (b + ("post_attention_norm" if oss else "ffn_norm") + ".weight", (s.hidden,))]
        if oss:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,)),
                    (b + "attn_output.bias", (s.hidden,)), (b + "attn_sinks.weight", (s.heads,))]
        if s.qk_norm:
            out += [(b + "attn_q_norm.weight", (s.head_dim,)), (b + "attn_k_norm.weight", (s.head_dim,))]
        if s.experts:
            E, inter = s.experts, s.expert_ffn
            out += [(b + "ffn_gate_inp.weight", (E, s.hidden)), (b + "ffn_gate_exps.weight", (E, inter, s.hidden)),
                    (b + "ffn_up_exps.weight", (E, inter, s.hidden)), (b + "ffn_down_exps.weight", (E, s.hidden, inter))]
            if oss:
                out += [(b + "ffn_gate_inp.bias", (E,)), (b + "ffn_gate_exps.bias", (E, inter)),
                        (b + "ffn_up_exps.bias", (E, inter)), (b + "ffn_down_exps.bias", (E, s.hidden))]
        else:
            out += [(b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden)),
                    (b + "ffn_down.weight", (s.hidden, s.ffn))]
    out.append(("output_norm.weight", (s.hidden,)))
    return out + [("output.weight", (vocab, s.hidden))] if oss else out


def prefill_macs(s: Shape) -> int:
    """Multiply-accumulates of one prompt token through the layers' linears (the LM head runs for
    the last token only, attention's own products are left out: 1-3% at 512 tokens; of a mixture
    of experts, the experts the token goes through)."""
    return int(sum(math.prod(sh) * (s.active_share if name.endswith("_exps.weight") else 1)
                   for name, sh in tensor_shapes(s, 1) if len(sh) >= 2 and name.startswith("blk.")))


FLOAT_TYPES = ("F16", "BF16")


def is_float32(name: str, shape: tuple[int, ...]) -> bool:
    """Norms, biases and sinks stay float32 (llama-quantize quantizes ``.weight`` matrices only)."""
    return len(shape) == 1 or name.endswith(".bias")


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Norm weights and sinks (1-D) are ones in float32, biases zeros; matrices (and stacks of
    them) N(0, STD) in float16, drawn in row chunks."""
    if name.endswith(".bias"):
        return np.zeros(shape, dtype=np.float32)
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    out = np.empty(shape, dtype=np.float16)
    rows = out.reshape(-1, shape[-1])
    step = max(1, (1 << 24) // shape[-1])
    for r in range(0, rows.shape[0], step):
        chunk = rng.standard_normal((min(step, rows.shape[0] - r), shape[-1]), dtype=np.float32)
        chunk *= STD
        rows[r:r + step] = chunk
    return out


def write_f16(path: Path, name: str, s: Shape) -> None:
    """Write the F16 GGUF of shape ``s``, one tensor in memory at a time."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType

    tok = tokenizer_fields(TOKENIZER_SOURCE)
    vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    tmp = path.with_suffix(".part")
    w = GGUFWriter(tmp, s.arch)
    w.add_name(f"random-{s.arch}-{name}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(vocab)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.context / 4096)
        w.add_rope_scaling_orig_ctx_len(4096)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    shapes = tensor_shapes(s, vocab)
    for tname, shape in shapes:
        dtype = np.float32 if is_float32(tname, shape) else np.float16
        qtype = GGMLQuantizationType.F32 if is_float32(tname, shape) else GGMLQuantizationType.F16
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for tname, shape in shapes:
        w.write_tensor_data(random_tensor(rng, tname, shape))
    w.close()
    tmp.rename(path)


def make_models(work: Path, shape_names: list[str], types: list[str], quantize_bin: Path) -> dict[tuple[str, str], Path]:
    """The GGUF of each (shape, type), written or quantized where not cached in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in shape_names:
        f16 = work / f"random-{SHAPES[name].arch}-{name}.F16.gguf"
        if not f16.is_file():
            t0 = time.perf_counter()
            write_f16(f16, name, SHAPES[name])
            print(f"wrote {f16} ({f16.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
        for qtype in types:
            out = f16 if qtype == "F16" else work / f"random-{SHAPES[name].arch}-{name}.{qtype}.gguf"
            if not out.is_file():
                quantize(quantize_bin, f16, out, qtype)
            files[(name, qtype)] = out
    return files


def quantize(binary: Path, src: Path, out: Path, qtype: str) -> None:
    """``llama-quantize`` of ``src`` to ``qtype``; the IQ types with an importance matrix of random
    column weights (``write_imatrix``: llama-quantize makes the 2-bit ones only with one)."""
    t0 = time.perf_counter()
    tmp = out.with_suffix(".part")
    args = [str(binary)]
    if qtype.startswith("IQ"):
        imatrix = src.with_suffix(".imatrix.gguf")
        if not imatrix.is_file():
            write_imatrix(src, imatrix)
        args += ["--imatrix", str(imatrix)]
    r = subprocess.run([*args, str(src), str(tmp), qtype], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-quantize {qtype} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    tmp.rename(out)
    print(f"quantized {out.name} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# Measuring


def memory_bandwidth(threads: int, gib: int = 2, tries: int = 5) -> tuple[float, str]:
    """``(bytes/s, how)`` of reading a ``gib`` GiB buffer once on ``threads`` threads, best of
    ``tries``: the native kernels' streaming read (``stream_read``: 64-byte lines, eight xor
    accumulators) where they build, else torch summing float32 (which reads slower than a decode).
    The native read takes two buffers in turn, one in ordinary 4 KiB pages (where llama.cpp's
    mapped file lies) and one in transparent huge pages (where localllm holds its repacked weights,
    ``memory.huge_page_buffer``), and answers the faster: the machine's limit either way."""
    import torch

    from localllm.kernels.cpu import native
    from localllm.platform.memory import huge_page_buffer

    torch.set_num_threads(threads)
    module = native.load()
    if module is not None:
        buffers = {"4 KiB pages": torch.ones(gib << 30, dtype=torch.uint8),
                   "huge pages": huge_page_buffer(gib << 30).fill_(1)}
        best = dict.fromkeys(buffers, 0.0)
        for _ in range(tries):
            for name, x in buffers.items():
                t0 = time.perf_counter()
                module.stream_read(x)
                best[name] = max(best[name], x.numel() / (time.perf_counter() - t0))
        figures = ", ".join(f"{value / 1e9:.1f} GB/s from {name}" for name, value in best.items())
        return max(best.values()), f"native streaming read ({module.isa()}), {threads} threads: {figures}"
    best = 0.0
    x = torch.ones(gib << 28, dtype=torch.float32)
    for _ in range(tries):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best, f"torch sum of float32, {threads} threads"


# A process's streaming read now (native, huge pages, 1 GiB, best of 3), bytes/s (None without the
# native kernels): the localllm child's just before and just after each decode, and a fresh process's
# just before and just after each llama-bench run. One process's read speed holds for its life but
# moves between processes here.
BANDWIDTH_NOW = r"""
def bandwidth():
    import time
    from localllm.kernels.cpu import native
    from localllm.platform.memory import huge_page_buffer
    module = native.load()
    if module is None:
        return None
    x, best = huge_page_buffer(1 << 30).fill_(1), 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        module.stream_read(x)
        best = max(best, x.numel() / (time.perf_counter() - t0))
    del x  # (unmapped: RSS as before)
    return best
"""


def fresh_bandwidth(threads: int) -> float | None:
    """``BANDWIDTH_NOW`` in a process of its own (on ``threads`` threads)."""
    code = BANDWIDTH_NOW + "\nimport json, torch\nprint(json.dumps(bandwidth()))\n"
    run = subprocess.run([sys.executable, "-c", code], env=localllm_env(threads), capture_output=True, text=True,
                         check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


LOCALLLM_CHILD = BANDWIDTH_NOW + r"""
import ctypes, json, math, os, sys, time
import torch
import transformers  # noqa: F401 - loaded before the baseline so RSS growth is the model's
from localllm import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def reply(**fields):
    try:  # return freed temporaries to the OS so RSS shows what the model holds
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    print(json.dumps({**fields, "rss_model": rss() - rss0 - kv}), flush=True)

model, gen, n_prompt, kv_memory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
greedy = lambda n, **kw: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)
rss0 = rss()
t0 = time.perf_counter()
llm = LLM(model=model, kv_cache_memory=kv_memory, enable_prefix_caching=False,
          speculative=os.environ["LOCALLLM_SPECULATIVE"])
load_s = time.perf_counter() - t0
kv = llm.engine.runner.write_kv_caches()  # resident whole, then subtracted
# Sanity: a few greedy tokens whose logprobs are finite (the first use also repacks what is left).
sanity = llm.generate(["The capital of France is"], greedy(4, logprobs=1))[0].outputs[0]
finite = all(math.isfinite(lp.logprob) for lp in sanity.logprobs) and len(sanity.token_ids) == 4
llm.generate([list(range(500, 628))], greedy(2))  # warm-up of the prefill path

def decode(prompt):  # as bench/single_stream.py: tokens after the first over the time since it came
    global ttft  # (and the prompt's time to the first token)
    n, first, t0 = 0, None, time.perf_counter()
    for out in llm.stream(prompt, greedy(gen + 1)):
        n += len(out.new_token_ids)
        first = first or time.perf_counter()
    ttft = first - t0
    return (n - 1) / (time.perf_counter() - first)

short = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a robot."}])
experts = [layer.mlp.experts for layer in llm.engine.model.layers if hasattr(layer.mlp, "experts")]
reply(load_s=load_s, kv=kv, held=llm.engine.backend.held_bytes(llm.engine.model), finite=finite,
      expert_held=sum(llm.engine.backend.held_bytes(e) for e in experts),
      sanity=sanity.text, kernels=str(llm.engine.kernels), threads=torch.get_num_threads())
fresh = 0
for line in sys.stdin:  # "measure REPS", "prefill REPS" or "context TOKENS", one JSON line back for each
    cmd, n = line.split()
    pp, tg = [], []
    bws = []  # per decode of "measure": the higher of the reads just before and just after it
    for _ in range(int(n) if cmd in ("measure", "prefill") else 0):
        fresh += 1
        prompt = [1000 + (i * 7 + fresh * 3001) % 40000 for i in range(n_prompt)]  # no prefix to reuse
        t0 = time.perf_counter()
        llm.generate([prompt], greedy(1))
        pp.append(n_prompt / (time.perf_counter() - t0))
        if cmd == "measure":
            before = bandwidth()
            tg.append(decode(short))
            bws.append(max(before or 0.0, bandwidth() or 0.0) or None)
    if cmd == "context":
        tg.append(decode([1000 + (i * 11) % 40000 for i in range(int(n))]))
        pp.append(int(n) / ttft)
    best = max(range(len(tg)), key=tg.__getitem__, default=None)
    reply(pp=max(pp, default=None), tg=None if best is None else tg[best],
          bw=bws[best] if bws and best is not None else None)
"""


class Localllm:
    """A child process holding ``model`` loaded in localllm (all ``threads``), measuring on demand
    (see ``LOCALLLM_CHILD``): a round's measurements, or a context's."""

    def __init__(self, model: Path, threads: int, context: int = 0, two_passes: bool = False,
                 kv_type: str = "f16") -> None:
        env = localllm_env(threads)
        env["LOCALLLM_KV_CACHE_DTYPE"] = kv_type
        if two_passes:  # the float32 reference's precision: int8x2
            env["LOCALLLM_CPU_ACTIVATIONS"] = "int8x2"
        kv_memory = "512MiB" if context <= 2048 else f"{max(512, context // 4)}MiB"
        args = [str(model), str(GEN_TOKENS), str(PROMPT_TOKENS), kv_memory]
        self.proc = subprocess.Popen([sys.executable, "-c", LOCALLLM_CHILD, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"localllm exited with status {self.proc.returncode}")
        return json.loads(line)

    def ask(self, cmd: str, n: int) -> dict:
        self.proc.stdin.write(f"{cmd} {n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure_file(bench_bin: Path, model: Path, threads: int, rounds: int, reps: int) -> dict:
    """Best of ``rounds`` rounds of localllm and llama-bench on ``model``, their order alternating
    (a program that fails is reported and left out). Each round of either program is a process of
    its own, as llama-bench's are: one process's decode speed holds for its life but moves between
    processes on this host (1B Q4_0, five processes one after another: 45.5, 61.4, 59.5, 60.8, 63.1
    tok/s), so a localllm kept loaded across rounds had one draw where llama.cpp had three."""
    runs = {"localllm": [], "llama.cpp": []}
    info, finite = None, True  # the first process's report; whether every process's logprobs were finite
    for rnd in range(rounds):
        for tool in ("localllm", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "localllm"):
            try:
                if tool == "localllm":
                    ll = Localllm(model, threads)
                    if info is None:
                        info = ll.info
                        print(f"  localllm loaded in {info['load_s']:.0f} s ({info['kernels']}); sanity "
                              f"{info['sanity']!r}, finite logprobs {info['finite']}", flush=True)
                    finite = finite and ll.info["finite"]
                    try:
                        r = ll.ask("measure", reps)
                    finally:
                        ll.close()
                else:
                    before = fresh_bandwidth(threads)
                    b = llama_bench(bench_bin, str(model), threads, reps, PROMPT_TOKENS, GEN_TOKENS)
                    r = {"pp": b[f"pp{PROMPT_TOKENS}"], "tg": b[f"tg{GEN_TOKENS}"],
                         "bw": max(before or 0.0, fresh_bandwidth(threads) or 0.0) or None}
            except (RuntimeError, subprocess.CalledProcessError, KeyError) as e:
                print(f"  round {rnd + 1} {tool} failed: {getattr(e, 'stderr', None) or e}", flush=True)
                continue
            runs[tool].append(r)
            bw = f", bandwidth then {r['bw'] / 1e9:.1f} GB/s" if r.get("bw") else ""
            print(f"  round {rnd + 1} {tool}: pp{PROMPT_TOKENS} {r['pp']:.1f}, tg{GEN_TOKENS} {r['tg']:.2f} tok/s{bw}",
                  flush=True)
    precise_pp = None
    if runs["localllm"]:  # prefill again with two activation passes (int8x2)
        try:
            precise = Localllm(model, threads, two_passes=True)
            precise_pp = precise.ask("prefill", reps)["pp"]
            precise.close()
            print(f"  localllm int8x2 (two passes): pp{PROMPT_TOKENS} {precise_pp:.1f} tok/s", flush=True)
        except RuntimeError as e:
            print(f"  localllm int8x2 (two passes) failed: {e}", flush=True)
    best = lambda tool, key: max((r[key] for r in runs[tool]), default=None)
    # the bandwidth around each program's best decode (the higher of the reads before and after it)
    best_bw = lambda tool: max(runs[tool], key=lambda r: r["tg"])["bw"] if runs[tool] else None
    done = runs["localllm"]
    return {
        "size": model.stat().st_size,
        "ll_tg": best("localllm", "tg"), "ll_pp": best("localllm", "pp"), "ll_pp_x2": precise_pp,
        "lc_tg": best("llama.cpp", "tg"), "lc_pp": best("llama.cpp", "pp"),
        "ll_bw": best_bw("localllm"), "lc_bw": best_bw("llama.cpp"),
        "held": info["held"] if done else None, "rss_model": done[-1]["rss_model"] if done else None,
        "expert_held": info["expert_held"] if done else None, "expert_file": expert_file_bytes(model),
        "finite": finite,
    }


def expert_file_bytes(model: Path) -> int:
    """Bytes of a mixture of experts' expert tensors in the file (0 for a dense model)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from localllm.models.gguf_file import read_gguf

    return sum(t.data.nbytes for name, t in read_gguf(model).tensors.items() if "_exps." in name)


def with_context(model: Path, tokens: int) -> Path:
    """``model``, or where its trained context is shorter than ``tokens``, a copy beside it that says
    ``tokens`` (the synthetic shapes keep Llama-3.2's 8192; random weights mind no RoPE position)."""
    import shutil

    from gguf import GGUFReader

    field = next((f for name, f in GGUFReader(model).fields.items() if name.endswith(".context_length")), None)
    if field is None or int(field.parts[field.data[0]][0]) >= tokens:
        return model
    longer = model.with_name(f"{model.stem}.ctx{tokens}.gguf")
    if not longer.exists():
        shutil.copyfile(model, longer.with_suffix(".part"))
        reader = GGUFReader(longer.with_suffix(".part"), "r+")
        key = next(name for name in reader.fields if name.endswith(".context_length"))
        reader.fields[key].parts[reader.fields[key].data[0]][0] = tokens
        del reader
        longer.with_suffix(".part").rename(longer)
    return longer


def measure_context(bench_bin: Path, model: Path, threads: int, context: int, reps: int,
                    kv_type: str = "f16") -> dict:
    """Decode tokens/s with ``context`` tokens already in the context, localllm then llama.cpp, both
    with ``kv_type`` for keys and values (llama.cpp with flash attention)."""
    model = with_context(model, context + 2 * GEN_TOKENS)
    child = Localllm(model, threads, context, kv_type=kv_type)
    got = child.ask("context", context)
    child.close()
    ll, ll_pp = got["tg"], got["pp"]
    lc = llama_bench(bench_bin, str(model), threads, reps, 0, GEN_TOKENS, depth=context,
                     kv_type=kv_type)[f"tg{GEN_TOKENS}"]
    lc_pp = llama_bench(bench_bin, str(model), threads, 1, context, 0, kv_type=kv_type)[f"pp{context}"]
    print(f"  context {context}, {kv_type} KV: decode localllm {ll:.2f}, llama.cpp {lc:.2f} tok/s; prefill "
          f"localllm {ll_pp:.1f}, llama.cpp {lc_pp:.1f} tok/s", flush=True)
    return {"context": context, "kv_type": kv_type, "ll": ll, "lc": lc, "ll_pp": ll_pp, "lc_pp": lc_pp}


def measure_clients(server_bin: Path, model: Path, threads: int, clients: int) -> dict:
    """Aggregate output tokens/s of ``clients`` streaming clients x GEN_TOKENS tokens on each server
    (llama-server with ``-np clients``)."""
    lc = run_llama_server(server_bin, str(model), threads, clients, clients, GEN_TOKENS)
    ll = run_localllm_server(str(model), threads, clients, GEN_TOKENS)
    print(f"  {clients} clients: localllm {ll['tok_s']:.1f}, llama-server {lc['tok_s']:.1f} tok/s", flush=True)
    return {"clients": clients, "ll": ll, "lc": lc}


# ---------------------------------------------------------------------------------------------
# Report


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def prefill_rate(tok_s: float | None, shape: str, qtype: str, passes: int, peaks: dict[str, Peak]) -> str:
    """G operations/s a prefill of ``tok_s`` tokens/s performs in the linears (``passes``
    activation passes of int8 products; F16/BF16 files: float32 FMAs, one pass) and its % of
    the peak of those instructions on this machine."""
    if tok_s is None:
        return "n/a"
    float_route = qtype in FLOAT_TYPES
    ops = tok_s * 2 * prefill_macs(SHAPES[shape]) * (1 if float_route else passes)
    peak = peaks["fma"] if float_route else int8_peak(peaks)
    return f"{ops / 1e9:.0f} ({100 * ops / peak.ops_per_s:.0f}%)"


def file_table(results: dict[tuple[str, str], dict], bandwidth: float, peaks: dict[str, Peak]) -> str:
    """One row per file; the decode bounds are bandwidth / bytes a token reads (localllm: its held
    weights; llama.cpp: the file, whose weights it reads in place; of a mixture of experts, the
    experts a token goes through and every other weight), the bandwidth the higher of the
    reads just before and just after each program's best decode (``bandwidth``, the run's start,
    where none was)."""
    head = ("| model | file MiB | localllm decode tok/s | llama.cpp tg64 | ratio | localllm pp512 | llama.cpp pp512 "
            "| ratio | localllm pp512 at int8x2, two passes (ratio) | pp512 G ops/s (% of peak): localllm (one pass) "
            "/ int8x2 (two) / llama.cpp | localllm MiB read per token | GB/s read then: localllm / llama.cpp "
            "| its bandwidth bound tok/s | localllm % of bound "
            "| llama.cpp % of its bound (file) | localllm RSS MiB, KV cache excluded (x file) |\n" + "|---" * 16 + "|\n")
    rows = []
    for (shape, qtype), r in results.items():
        size, held, rss = r["size"], r["held"], r["rss_model"]
        # a mixture of experts: a token reads its experts_used of each layer's experts, not all of them
        unread = 1.0 - SHAPES[shape].active_share
        if held:
            held -= unread * (r.get("expert_held") or 0)
        read = size - unread * (r.get("expert_file") or 0)  # llama.cpp reads the file's weights in place
        ll_bw, lc_bw = r.get("ll_bw") or bandwidth, r.get("lc_bw") or bandwidth
        bound = ll_bw / held if held else None
        cells = [
            f"{shape} {qtype}", f"{size / 2**20:.0f}",
            fmt(r["ll_tg"], ".2f"), fmt(r["lc_tg"], ".2f"), fmt(ratio(r["ll_tg"], r["lc_tg"]), ".2f", "x"),
            fmt(r["ll_pp"], ".1f"), fmt(r["lc_pp"], ".1f"), fmt(ratio(r["ll_pp"], r["lc_pp"]), ".2f", "x"),
            "n/a" if r.get("ll_pp_x2") is None else
            f"{r['ll_pp_x2']:.1f} ({fmt(ratio(r['ll_pp_x2'], r['lc_pp']), '.2f', 'x')})",
            " / ".join(prefill_rate(pp, shape, qtype, passes, peaks)
                       for pp, passes in ((r["ll_pp"], 1), (r["ll_pp_x2"], 2), (r["lc_pp"], 1))),
            fmt(held and held / 2**20, ".0f"), f"{ll_bw / 1e9:.1f} / {lc_bw / 1e9:.1f}", fmt(bound, ".1f"),
            fmt(ratio(r["ll_tg"], bound) and 100 * ratio(r["ll_tg"], bound), ".0f", "%"),
            fmt(r["lc_tg"] and 100 * r["lc_tg"] * read / lc_bw, ".0f", "%"),
            "n/a" if rss is None else f"{rss / 2**20:.0f} ({rss / size:.2f}x)",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"


def peak_line(peaks: dict[str, Peak], shapes: list[str]) -> str:
    """The instruction peaks of ``bench/cpu_peak.py`` the prefill column is a percentage of."""
    int8 = int8_peak(peaks)
    return (f"\nPeaks on {int8.threads} threads (`bench/cpu_peak.py`, independent instructions, no memory traffic): "
            f"{int8.label} {int8.ops_per_s / 1e9:.0f} G int8 ops/s ({peaks['maddubs'].label}: "
            f"{peaks['maddubs'].ops_per_s / 1e9:.0f}), {peaks['fma'].label} {peaks['fma'].ops_per_s / 1e9:.0f} G flops/s. "
            "pp512 G ops/s: 2 x the linears' multiply-accumulates per prompt token "
            f"({', '.join(f'{prefill_macs(SHAPES[n]) / 1e6:.0f} M for {n}' for n in shapes)}) x tokens/s x activation passes (localllm's default "
            "takes one int8 pass, int8x2 two; llama.cpp one), against the int8 peak (F16/BF16 files: the float32 FMA peak, "
            "one pass; localllm holds their LM head in 8 bits).\n")


def context_table(rows: list[dict], model: str) -> str:
    out = (f"\nLong prompts, {model}, tokens/s: the prompt's prefill (localllm: its tokens over the time to the "
           "first token; llama-bench `-p N -n 0`) and 64 tokens decoded after it (llama-bench `-n 64 -d N`), both "
           "programs with the KV cache type (`-ctk T -ctv T -fa 1`):\n\n"
           "| prompt | KV cache | prefill localllm | llama.cpp | ratio | decode localllm | llama.cpp | ratio |\n"
           "|---|---|---|---|---|---|---|---|\n")
    for c in rows:
        out += (f"| {c['context']} | {c['kv_type']} | {c['ll_pp']:.1f} | {c['lc_pp']:.1f} | {c['ll_pp'] / c['lc_pp']:.2f}x "
                f"| {c['ll']:.2f} | {c['lc']:.2f} | {c['ll'] / c['lc']:.2f}x |\n")
    return out


def clients_table(rows: list[dict], model: str) -> str:
    out = (f"\n{model}, concurrent streaming clients x {GEN_TOKENS} tokens through `/v1/completions` "
           "(llama-server `-np` = clients), aggregate output tokens/s:\n\n"
           "| clients | localllm | llama-server | ratio | TTFT p50 s (localllm / llama-server) |\n|---|---|---|---|---|\n")
    for c in rows:
        ll, lc = c["ll"], c["lc"]
        out += (f"| {c['clients']} | {ll['tok_s']:.1f} | {lc['tok_s']:.1f} | {ll['tok_s'] / lc['tok_s']:.2f}x "
                f"| {ll['ttft_p50']:.2f} / {lc['ttft_p50']:.2f} |\n")
    return out


def command_line(args: argparse.Namespace) -> str:
    cmd = f"python bench/real_size.py --shapes {args.shapes} --types {args.types} --threads {args.threads} " \
          f"--rounds {args.rounds} --reps {args.reps}"
    if args.clients:
        cmd += f" --clients {args.clients}"
    if args.context:
        cmd += f" --context {args.context} --kv-types {args.kv_types}"
    return cmd


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--types", default=DEFAULT_TYPES, help=f"llama-quantize types, or 'all' ({ALL_TYPES})")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="repetitions inside one measurement (best / llama-bench mean)")
    ap.add_argument("--clients", default="", help="e.g. 16,32: concurrent clients on the first shape's Q4_K_M")
    ap.add_argument("--context", default="", help="e.g. 4096,8192: decode after a prompt of that many tokens (Q4_K_M)")
    ap.add_argument("--kv-types", default="f16", help="with --context: the KV cache types, e.g. f16,q8_0,q4_0")
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "localllm-real-size"))
    ap.add_argument("--make-only", action="store_true", help="write and quantize the models, measure nothing")
    ap.add_argument("--peer-version", default=PEER_VERSION)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--section", default="real_size", help="the docs/performance.md section the tables go to")
    args = ap.parse_args()
    if args.types == "all":
        args.types = ALL_TYPES
    return args


def main() -> None:
    args = parse_args()
    shapes, types = args.shapes.split(","), args.types.split(",")
    bins = build_peer(args.peer_version)
    files = make_models(Path(args.work_dir).expanduser(), shapes, types, bins["llama-quantize"])
    if args.make_only:
        return
    bandwidth, bandwidth_how = memory_bandwidth(args.threads)
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s ({bandwidth_how})", flush=True)
    peaks = measure_peaks(args.threads)
    print(peak_line(peaks, shapes), flush=True)

    results, extra, focus = {}, "", (shapes[0], "Q4_K_M")
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored)
        signal.signal(sig, signal.default_int_handler)
    try:  # SIGINT or SIGTERM stops measuring and reports the files measured so far
        for (shape, qtype), path in files.items():
            print(f"{path.name}:", flush=True)
            results[(shape, qtype)] = measure_file(bins["llama-bench"], path, args.threads, args.rounds, args.reps)
        contexts = [measure_context(bins["llama-bench"], files[focus], args.threads, context, args.reps, kv_type)
                    for context in (int(n) for n in args.context.split(",") if n) if focus in files
                    for kv_type in args.kv_types.split(",")]
        if contexts:
            extra += context_table(contexts, " ".join(focus))
        if args.clients and focus in files:
            rows = [measure_clients(bins["llama-server"], files[focus], args.threads, int(n))
                    for n in args.clients.split(",")]
            extra += clients_table(rows, " ".join(focus))
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured", flush=True)
        extra += "\n(Interrupted before the end: only the rows above were measured.)\n"

    import torch

    stamp = (f"{datetime.date.today()}, {cpu_name()} ({os.cpu_count()} cores), {args.threads} threads each, "
             f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s ({bandwidth_how}, 2 GiB), torch {torch.__version__}, "
             f"llama.cpp from {PEER_PACKAGE} {args.peer_version}; best of {args.rounds} alternating rounds")
    notes = ("\nRandom weights (std 0.02) in Llama-3.2 shapes with SmolLM2's 49152-token vocabulary, tied embeddings. "
             "MiB read per token: localllm's weights as its kernels hold them (`held_bytes`, the tied embedding "
             "counted once as the LM head), KV cache left out; the bound is bandwidth / those bytes (llama.cpp's: "
             "bandwidth / file size), the bandwidth read (1 GiB in huge pages, best of 3) just before and "
             "just after each program's best decode, the higher of the two, localllm's in its own process, "
             "llama.cpp's in fresh ones: this host's bandwidth "
             "moves by the minute and one process's read speed holds for its life but moves between processes. "
             "RSS: localllm's process growth for load + run, KV cache excluded.\n")
    text = f"`{command_line(args)}` ({stamp}):\n\n{file_table(results, bandwidth, peaks)}{notes}{peak_line(peaks, shapes)}{extra}"
    if not all(r["finite"] for r in results.values()):
        text += "\nWarning: non-finite logprobs in localllm's sanity generation for some file.\n"
    print(text)
    if args.write_docs:
        data = {"kind": "cpu_vs_llamacpp", "machine": cpu_name(), "date": str(datetime.date.today()),
                "bandwidth_gb_s": bandwidth / 1e9,
                "files": {" ".join(key): {k: v for k, v in r.items() if isinstance(v, (int, float)) or v is None}
                          for key, r in results.items()}}
        write_section(args.section, text, data=data)


if __name__ == "__main__":
    main()
