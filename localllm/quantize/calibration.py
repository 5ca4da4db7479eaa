"""Calibration: the token sequences GPTQ sees, and running the model's layers on them.

The text is a UTF-8 file (``--calibration FILE``), or by default text the source model writes
itself (data-free calibration): :func:`sample_calibration` has it answer a fixed list of writing
tasks on everyday topics (:data:`CALIBRATION_TOPICS`), seeded, at temperature 1 with top-p 0.95,
through the engine's model runner and sampler (:func:`sample_continuations`), and the answers,
tokenized as plain text, join the built-in English text.

Per decoder layer, "true sequential": :func:`quantize_layer` runs the layer on the calibration
batch with a forward pre-hook on the first linear of each of :data:`SEQUENTIAL_GROUPS`: the hook
receives the group's inputs, quantizes the group (:mod:`localllm.quant.gptq.algorithm`) and swaps
the dequantized weights in before the group runs, so later groups see the quantized outputs of
earlier ones. :func:`layer_inputs` collects the float layer's inputs the same way (the GPTAQ
targets).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from localllm.engine.model_runner import ModelRunner, prefill_batch
from localllm.engine.sampler import SampleRequest, sample
from localllm.errors import InvalidRequestError
from localllm.models.decoder import DecoderLayer, DecoderModel
from localllm.quant.gptq.algorithm import (
    SEQUENTIAL_GROUPS,
    GPTQSettings,
    QuantizedMatrix,
    gptaq_target,
    gptq_quantize_matrix,
)
from localllm.sampling_params import SamplingParams
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request

DEFAULT_CALIBRATION_TEXT = """\
The history of the bicycle is a story of small improvements. The first machines of the early
nineteenth century had no pedals at all: riders sat on a wooden frame and pushed themselves
along with their feet. Cranks attached to the front wheel came decades later, and the chain
drive, the diamond-shaped frame and the air-filled tyre followed before the century was over.
By 1900 the safety bicycle looked much like the ones people ride today, and it had changed how
workers travelled to factories and how young people met each other on Sunday afternoons.

To bake a simple loaf of bread, mix five hundred grams of flour with a teaspoon of salt, a
small packet of dried yeast and about three hundred millilitres of warm water. Knead the dough
for ten minutes until it is smooth and elastic, then leave it in a covered bowl until it has
doubled in size. Shape it, let it rise once more, and bake it in a hot oven for around thirty
minutes. The loaf is done when it sounds hollow if you tap the bottom.

Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical
energy. Inside the chloroplasts, chlorophyll absorbs mostly red and blue light, which is why
leaves look green. The energy splits water molecules, releasing oxygen, and drives the reactions
that combine carbon dioxide into sugars. Nearly every food chain on Earth begins with this
quiet work, and the oxygen we breathe is one of its by-products.

Dear Maria, thank you for your letter and for the photographs from the mountains. We are all well
here, although the weather has been cold and wet for most of the month. The children have started
school again and are already asking when we can visit you. Perhaps in the spring, when the roads
are clear? Please give our best wishes to your parents, and write again soon.

A good habit when writing software is to make each function do one thing and to give it a name
that says what that thing is. Tests should describe the behaviour that users rely on rather than
the details of how it is implemented. When a program fails, it should say clearly what went wrong
and, where it can, what the user might do about it.

"How far is it to the station?" asked the traveller. "Not far," said the old woman, pointing down
the road. "Walk past the church and the bakery, turn left at the river, and you will see it on the
other side of the bridge. If you hurry, you will catch the evening train to the city."
"""

def calibration_sequences(tokenizer, text: str, seq_len: int = 512, max_tokens: int = 16384) -> list[list[int]]:
    """``text`` as token sequences of at most ``seq_len`` tokens (BOS first where the model wants it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    bos = _bos(tokenizer)
    step = seq_len - len(bos)
    seqs = [bos + ids[i : i + step] for i in range(0, len(ids), step)]
    seqs = [s for s in seqs if len(s) >= 8]
    if sum(len(s) for s in seqs) < 32:
        raise InvalidRequestError("the calibration text is too short (it needs at least 32 tokens)", param="calibration")
    return seqs


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []


# --- calibration text the model writes itself -----------------------------------------------------

DEFAULT_CALIBRATION_TOKENS = 8192
"""Tokens of self-written calibration text by default (on top of the built-in text)."""

CALIBRATION_TOPICS: tuple[str, ...] = (
    "the history of the printing press", "how rain forms", "a day on a dairy farm", "saving money on groceries",
    "the life of honey bees", "planting tomatoes in a small garden", "a summer holiday, in a letter to a friend",
    "how bicycle gears work", "the rules of chess", "a rainy afternoon in a big city", "why we need sleep",
    "the first railways", "how to make a good cup of tea", "the Roman army", "a child's first day at school",
    "how vaccines work", "the planets of the solar system", "a walk through an autumn forest",
    "changing a flat tyre", "the history of coffee", "an argument between two neighbours",
    "writing a good job application", "the water cycle", "a grandfather's memories of his youth",
    "how computers store numbers", "the invention of the telephone", "a birthday party that went wrong",
    "the importance of exercise", "how bread rises", "a mountain village in winter",
    "the causes of the French Revolution", "learning to play the piano", "how elections work",
    "a cat that keeps escaping", "reading to young children", "how glaciers shape valleys",
    "a busy railway station", "the history of the Olympic Games", "recycling plastic",
    "a detective solving a small mystery", "how the heart pumps blood", "the growth of cities in the 1800s",
    "a family cooking dinner together", "training a puppy", "the desert at night",
    "an old woman who runs a bookshop", "how airplanes stay in the air", "the music of Mozart",
    "a football match in the rain", "why leaves change colour", "the Silk Road", "how to write a short story",
    "a power cut in an apartment building", "the life cycle of a butterfly", "how banks lend money",
    "a farmer during a drought", "the discovery of penicillin", "a road trip across the country",
    "preparing for an exam", "the ancient Egyptians", "how a city gets its drinking water",
    "a quarrel between two brothers", "the first flight to the moon", "making friends in a new town",
)
"""Everyday topics for the self-written calibration text (general English prose, no one domain)."""

CALIBRATION_TASKS: tuple[str, ...] = (
    "Write a short story about {}.", "Explain {} in a few paragraphs.", "Describe {} in detail.",
    "Write an essay about {}.",
)

_SAMPLE_MAX_NEW_TOKENS = 256
_SAMPLE_MAX_BATCH = 64
_SAMPLE_KV_BYTES = 1 << 30  # KV cache budget of one sampling batch
_SAMPLE_TOP_CANDIDATES = 1024  # top_k of the sampling: top-p is applied within the most likely tokens


def calibration_prompts(tokenizer) -> list[list[int]]:
    """One prompt per topic and task, topics first (the first ``len(CALIBRATION_TOPICS)`` prompts
    cover every topic once): chat prompts where the model has its own chat template, else the
    task as plain text followed by a blank line."""
    from localllm.tokenizer import DEFAULT_CHAT_TEMPLATE

    chat = tokenizer.chat_template != DEFAULT_CHAT_TEMPLATE
    prompts = []
    n = len(CALIBRATION_TOPICS)
    for j in range(n * len(CALIBRATION_TASKS)):
        task = CALIBRATION_TASKS[(j // n + j) % len(CALIBRATION_TASKS)].format(CALIBRATION_TOPICS[j % n])
        if chat:
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": task}]))
        else:
            prompts.append(_bos(tokenizer) + tokenizer.encode(task + "\n\n", add_special_tokens=False))
    return prompts



@torch.inference_mode()
def sample_continuations(model: DecoderModel, prompts: list[list[int]], max_new_tokens: int,
                         generator: torch.Generator, stop_ids=frozenset(), temperature: float = 1.0,
                         top_p: float = 0.95, max_total_tokens: int | None = None) -> list[list[int]]:
    """Sample a continuation of each prompt, all in one batch (one prefill, then one decode step
    per token for every row; a row's tokens end before its first stop token). With
    ``max_total_tokens``, sampling ends once the rows hold that many tokens together.

    The steps run on the engine's own :class:`~localllm.engine.model_runner.ModelRunner` (its paged KV
    cache and attention metadata) and draw with the engine's sampler (:func:`localllm.engine.sampler.sample`,
    ``SamplingParams(temperature, top_p, top_k=1024)``: top-p within the most likely tokens).
    The sampler is handed each row's top-k logits only (the other tokens have probability 0
    under ``top_k``), which keeps a step's sampling as cheap as one batched top-k. Every row
    draws from ``generator`` in turn, and a row that has stopped keeps its place in the batch,
    so the result depends on the batch as a whole: reproducible for the same prompts, seed and
    machine.
    """
    B = len(prompts)
    block = 16
    nb = -(-(max(len(p) for p in prompts) + max_new_tokens) // block)
    runner = ModelRunner(model, B * nb, block, torch.device("cpu"))
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=_SAMPLE_TOP_CANDIDATES,
                            max_tokens=max_new_tokens)
    requests = [Request(f"calibration-{i}", list(p), params) for i, p in enumerate(prompts)]
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(B)]
    step = SchedulerOutput([ScheduledRequest(r, r.prompt_token_ids, 0, tables[i], True) for i, r in enumerate(requests)])
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    length = [max_new_tokens] * B
    stops = frozenset(stop_ids)
    for t in range(max_new_tokens):
        logits, rows = runner.compute_logits(step)
        order = {s.req_id: j for j, s in enumerate(rows)}  # the runner puts single-token rows first
        logits = logits[torch.tensor([order[r.req_id] for r in requests])].float()
        top, candidates = logits.topk(min(_SAMPLE_TOP_CANDIDATES, logits.shape[-1]), dim=-1)
        result = sample(top, [SampleRequest(params, r.prompt_token_ids, out[i], generator)
                              for i, r in enumerate(requests)])
        for i, j in enumerate(result.token_ids):
            token = int(candidates[i, j]) if j >= 0 else -1
            out[i].append(token)
            if not done[i] and (i in result.errors or token in stops):
                length[i], done[i] = t, True
        if all(done) or t + 1 == max_new_tokens:
            break
        if max_total_tokens is not None and sum(length[i] if done[i] else t + 1 for i in range(B)) >= max_total_tokens:
            length = [length[i] if done[i] else t + 1 for i in range(B)]
            break
        # a row that could not be sampled (-1: non-finite logits) has stopped; it feeds token 0 on
        step = SchedulerOutput([ScheduledRequest(r, [max(out[i][-1], 0)], len(r.prompt_token_ids) + t, tables[i], True)
                                for i, r in enumerate(requests)])
    return [out[i][: length[i]] for i in range(B)]


def sample_calibration(src: str | Path, tokenizer, num_tokens: int, seq_len: int = 512, *, seed: int = 0,
                       progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """About ``num_tokens`` tokens of calibration text written by the model ``src`` itself.

    The model (loaded as ``localllm run`` loads it, on the fast CPU path) answers
    :func:`calibration_prompts` in turn, sampled with ``seed`` at temperature 1 and top-p 0.95,
    up to 256 tokens per answer; each answer is tokenized again as plain text (BOS first where
    the model wants it) without its prompt, so the calibration set is general English prose.
    """
    from localllm.kernels.select import fastest_cpu_backend
    from localllm.models.assembler import load_model

    model = load_model(Path(src))[0]
    # sampling only needs plausible text: the fast CPU route where there is one (even with LOCALLLM_CPU_FAST=0)
    fastest_cpu_backend().install(model)
    prompts = calibration_prompts(tokenizer)
    c = model.config
    max_new = min(_SAMPLE_MAX_NEW_TOKENS, c.max_position_embeddings - max(len(p) for p in prompts))
    if max_new < 16:
        return []
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8
    longest = max(len(p) for p in prompts) + max_new
    max_batch = max(1, min(_SAMPLE_MAX_BATCH, _SAMPLE_KV_BYTES // (kv_per_token * longest)))
    generator = torch.Generator().manual_seed(seed)
    bos = _bos(tokenizer)
    seqs: list[list[int]] = []
    total, next_prompt = 0, 0
    while num_tokens - total >= 8:
        # Most answers run to max_new tokens; sample 10% more than needed (tokenized again as
        # plain text, an answer may come out a little shorter), in as few batches as may be.
        wanted = math.ceil(1.1 * (num_tokens - total))
        batch = min(max_batch, math.ceil(wanted / max_new))
        chosen = [prompts[(next_prompt + j) % len(prompts)] for j in range(batch)]
        next_prompt += batch
        answers = sample_continuations(model, chosen, max_new, generator, tokenizer.stop_token_ids,
                                       max_total_tokens=wanted)
        before = total
        for answer in answers:
            ids = bos + tokenizer.encode(tokenizer.decode(answer).strip(), add_special_tokens=False)
            ids = ids[: min(seq_len, num_tokens - total)]
            if len(ids) - len(bos) >= 8:
                seqs.append(ids)
                total += len(ids)
            if num_tokens - total < 8:
                break
        if progress is not None:
            progress(total, num_tokens)
        if total == before:  # nothing usable (a model that stops at once): keep what there is
            break
    return seqs


@torch.inference_mode()
def perplexity(model: DecoderModel, ids: list[int]) -> float:
    """Perplexity of ``model`` on one sequence of token ids (each token predicted from those before)."""
    if len(ids) < 2:
        raise InvalidRequestError("perplexity needs at least two tokens")
    positions, meta, kv = prefill_batch([len(ids)], model.config, model.dtype)
    device = next((b.device for b in model.buffers()), torch.device("cpu"))
    meta.slot_mapping, meta.block_tables, meta.context_lens = (
        meta.slot_mapping.to(device), meta.block_tables.to(device), meta.context_lens.to(device))
    ids_t = torch.tensor(ids, device=device)
    hidden = model(ids_t, positions.to(device), meta, [k.to(device) for k in kv])
    logits = model.compute_logits(hidden[:-1]).float()
    return math.exp(nn.functional.cross_entropy(logits, ids_t[1:]).item())


def layer_inputs(layer: DecoderLayer, modules: list[nn.Module], positions, h, kv, meta):
    """Run ``layer`` on ``h``; the output, and the inputs ``X [T, K]`` each of ``modules`` saw."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda _mod, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, m in enumerate(modules)
    ]
    try:
        out = layer(positions, h, kv, meta)
    finally:
        for handle in handles:
            handle.remove()
    return out, [seen[i].float() for i in range(len(modules))]


def quantize_layer(layer: DecoderLayer, linears: dict[str, nn.Module], settings: GPTQSettings,
                   positions, h, kv, meta, fp_inputs: list[torch.Tensor] | None,
                   on_group: Callable[[tuple[str, ...], QuantizedMatrix], None]) -> torch.Tensor:
    """Quantize ``layer``'s linears group by group while it runs on ``h``; returns its output.

    A pre-hook on each group's first linear receives the group's inputs, quantizes the whole group
    (``on_group`` gets the result) and swaps in the dequantized weights before the group runs, so
    later groups see the quantized outputs of earlier ones ("true sequential") in one pass.
    """

    def hook(group: tuple[str, ...], index: int):
        def run(_mod, args):
            X = args[0].reshape(-1, args[0].shape[-1]).float()
            H = (2.0 / X.shape[0]) * (X.t() @ X)
            W = torch.cat([linears[m].weight for m in group])
            if fp_inputs is not None:
                W = gptaq_target(W, X, fp_inputs[index], H, settings.damp)
                fp_inputs[index] = None  # free it
            qm = gptq_quantize_matrix(W, H, settings)
            on_group(group, qm)
            start = 0
            for m in group:
                n = linears[m].weight.shape[0]
                linears[m].weight = qm.rows(start, start + n).dequantize()
                start += n
        return run

    handles = [linears[g[0]].register_forward_pre_hook(hook(g, i)) for i, g in enumerate(SEQUENTIAL_GROUPS)]
    try:
        return layer(positions, h, kv, meta)
    finally:
        for handle in handles:
            handle.remove()

