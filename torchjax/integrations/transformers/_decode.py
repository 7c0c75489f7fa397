"""Greedy and sampled decoding as device work: a compiled program per token, or one loop.

Note [Decode steps as one program]
transformers' ``_sample`` loop runs, around each compiled forward, a dozen small ops of
bookkeeping: slicing the last token, growing ``input_ids`` and the attention mask by
``cat`` (a new shape every token), the logits processors, the token choice, the
stopping criteria and a host read of "is any sequence unfinished". On "tpu" each is an
eager op, and the ``cat``s compile a new program per length. ``compile_generate`` sends
greedy and sampled generation of a decoder-only model with a static cache here instead
(through generate's ``custom_generate`` hook), where every token is one ``torchjax.jit``
program, or all of them one loop:

- the tokens live in a buffer preallocated on the device, as long as the static cache
  and one more (the last token is never fed back); the attention mask is built once at
  the cache's length (prompt mask, then ones: positions not
  written yet are after the query, so causal masking hides them as the growing mask
  did); the write position, the next position ids, the unfinished flags and the length
  at which every sequence had finished are 0-d or small tpu tensors. The step program
  reads the last token, runs the model's forward over the static cache, applies the
  logits processors, picks the token (argmax, or ``multinomial`` from torchjax's RNG),
  writes it and updates the flags, all in place (written back);
- the prompt runs through transformers' own ``_prefill`` (the compiled prefill of
  Note [Compiled generation with a static cache]); the state above is written and the
  first token chosen, by the same selection code, by a second traced function (Note [The
  step after the prefill]), which on a warm call runs inside the loop's program;
- the decode step is traced first, without running; when its trace leaves the cache's
  Python state as it found it (static layers: their positions are tensors), every step
  runs as one program, ``decode_step.repeat`` (Note [Repeating a traced step in one
  program] in torchjax/compile/_repeat.py): a ``lax.while_loop`` that stops at the
  maximum length or once every sequence has finished, then one host read: the length at
  which every sequence had finished (the loop stopped right after that step, so the
  result's length is it or the maximum length). On a warm call the step's signature is
  looked up once (``repeat(..., when=...)``), not once to trace and once to run. So a
  whole warm ``generate`` is two program calls whatever its length (the prefill, then
  the first token and the loop: Note [A first call in the loop's program] in
  torchjax/compile/_repeat.py; three on a first call), and the step's forward
  compiles once, inside the loop (run once on its own first, it compiled twice: a third
  of a first call's compile time);
- with ``compile_generate(model, loop=False)``, or a cache whose Python state moves per
  token (guarded, so that would retrace per token), each token is one call of the step
  program, and the host reads the finish length every ``CHECK_EVERY`` (16) tokens, not
  each token: a batch that finishes early runs up to 15 steps more, whose tokens are cut
  off, so the result equals transformers' (which stops right after the step where the
  last sequence finished). Those steps write cache positions past the result: the
  cache is never returned here (``return_dict_in_generate`` falls back).

What runs here, and what falls back to transformers' loop unchanged: the processors of
``_processor_types`` (temperature, top-k, top-p, min-p, repetition penalty, min length,
min new tokens, no repeated n-grams), the stopping criteria max length and EOS, model inputs among
``_MODEL_KWARGS``; anything else (another processor or criterion, a streamer,
``return_dict_in_generate``, ``inputs_embeds``, token type ids, an encoder-decoder model,
input ids on another device, beams, assisted decoding) runs transformers' own loop, where
the forward is still compiled. The processors run inside the trace as transformers wrote
them, with the buffer as ``input_ids``: positions not written yet hold the vocabulary
size, which repetition penalty clamps and drops; the two length processors read a length
from ``input_ids.shape``, so their rule runs here with the traced position instead, and
so does the n-gram rule (Note [Repeated n-grams barred on the device]). Processors and
criteria are part of the program's key by their settings, so a new ``generate`` call
with the same settings reuses the programs.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import torch

from torchjax._compat.torch_modules import calls_run_no_hooks
from torchjax.compile._keys import Keyed
from torchjax.compile._state import shared_walks
from torchjax.integrations.transformers._cache_state import (
    _python_state,
    _replay,
    _static_cache,
    cache_room,
    zero_ahead,
)
from torchjax.ops.copy import to_cpu
from torchjax.tensor._tensor import JaxTensor

# Model inputs the decode step builds itself; others pass through when they are plain
# values (``logits_to_keep``), constants of the program and part of its key.
_MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "cache", "use_cache"})
_PLAIN = (type(None), bool, int, float, str)
CHECK_EVERY = 16
_LOCAL = threading.local()  # the processor objects of the call being traced


def _processor_types():
    from transformers.generation import logits_process as lp

    return {
        lp.TemperatureLogitsWarper,
        lp.TopKLogitsWarper,
        lp.TopPLogitsWarper,
        lp.MinPLogitsWarper,
        lp.RepetitionPenaltyLogitsProcessor,
        lp.MinLengthLogitsProcessor,
        lp.MinNewTokensLengthLogitsProcessor,
        lp.NoRepeatNGramLogitsProcessor,
    }


def _values(t: torch.Tensor) -> tuple:
    """``t``'s elements as Python numbers, read without dispatching torch ops: the EOS
    and pad ids transformers just made from Python ints come from their host values
    (Note [Host values of tensors made from host data] in torchjax/tensor/_shadows.py),
    and an eager op costs about 0.3 ms of host time on the chip."""
    if isinstance(t, JaxTensor):
        t = to_cpu(t)
    return tuple(t.reshape(-1).tolist())


def _setting(value):
    """A hashable form of one processor attribute (tensors by their values, once per call)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", _values(value))
    if isinstance(value, (list, tuple)):
        return tuple(_setting(v) for v in value)
    return value


def _spec(processors) -> tuple:
    return tuple(
        (type(p), tuple(sorted((k, _setting(v)) for k, v in vars(p).items()))) for p in processors
    )


def _rules(processors) -> tuple:
    """Per processor: None (it runs as written) or the rule that runs in its place: for the
    two length processors ``("length", start, least, eos ids)`` (EOS is barred while
    ``pos - start < least``), for the n-gram processor ``("ngram", n)``."""
    from transformers.generation import logits_process as lp

    rules = []
    for p in processors:
        if isinstance(p, lp.MinLengthLogitsProcessor):
            rules.append(("length", 0, p.min_length, _values(p.eos_token_id)))
        elif isinstance(p, lp.MinNewTokensLengthLogitsProcessor):
            ids = _values(p.eos_token_id)
            rules.append(("length", p.prompt_length_to_skip, p.min_new_tokens, ids))
        elif isinstance(p, lp.NoRepeatNGramLogitsProcessor):
            rules.append(("ngram", p.ngram_size))
        else:
            rules.append(None)
    return tuple(rules)


def fallback_reason(model, input_ids, processors, criteria, config, model_kwargs) -> str | None:
    """Why this call must run transformers' own loop, or None when it runs here."""
    from transformers.generation import stopping_criteria as sc
    from transformers.generation.configuration_utils import GenerationMode

    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value}"
    if model.config.is_encoder_decoder:
        return "an encoder-decoder model"
    if input_ids.device != model.device:
        # transformers moves such inputs to the model's device before each forward.
        return f"input ids on {input_ids.device}, the model on {model.device}"
    if config.return_dict_in_generate:
        return "return_dict_in_generate"
    extra = {
        k for k, v in model_kwargs.items() if not isinstance(v, _PLAIN) and k not in _MODEL_KWARGS
    }
    if extra:
        return f"model inputs {sorted(extra)}"
    if not model_kwargs.get("use_cache", True) or _static_cache(model_kwargs) is None:
        return "no static cache"
    cache = model_kwargs["cache"]
    if any(getattr(cache, "is_linear", ()) or ()):
        return "a cache with linear-attention layers"
    allowed = _processor_types()
    for p in processors:
        if type(p) not in allowed:
            return f"logits processor {type(p).__name__}"
    for c in criteria:
        if type(c) not in (sc.MaxLengthCriteria, sc.EosTokenCriteria):
            return f"stopping criterion {type(c).__name__}"
    lengths = [c.max_length for c in criteria if type(c) is sc.MaxLengthCriteria]
    if not lengths or input_ids.shape[-1] >= min(lengths):
        return "no max length, or a prompt that reaches it"
    rows = vars(model)["forward"].positions
    if rows is not None and min(lengths) > rows:
        # Each step's positions are checked in transformers' loop (the compiled forward).
        return f"a max length past the learned position table ({rows} positions)"
    room = cache_room(cache)
    # generate sizes the cache max_length - 1: the last token is never fed back.
    if room is None or room < min(lengths) - 1 or any(getattr(cache, "is_sliding", ()) or ()):
        # (too short: the compiled forward's own check raises IndexError at the step)
        return "a static cache shorter than max_length, or with sliding layers"
    return None


def device_sample(
    self,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    **model_kwargs,
):
    """generate's decoding method for models under ``compile_generate`` (see the Note):
    greedy / sampled decoding with each token one program, else transformers' own."""
    from transformers.generation import stopping_criteria as sc
    from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin

    why = None if streamer is None and not synced_gpus else "a streamer or synced_gpus"
    why = why or fallback_reason(
        self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs
    )
    wrapper = vars(self)["forward"]
    wrapper.last_fallback = why
    if why is not None:
        mode = generation_config.get_generation_mode()
        name = GENERATION_MODES_MAPPING[mode]
        if "/" in name:  # a mode transformers moved to a Hub repository
            raise ValueError(
                f"compile_generate: {mode.value} lives in the Hub repository {name!r}, which "
                f"generate loads only when called as written: pass custom_generate={name!r} "
                "(and trust_remote_code=True) to generate"
            )
        method = getattr(type(self), name)
        extra = {"streamer": streamer} if streamer is not None else {}
        return method(
            self,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            synced_gpus=synced_gpus,
            **extra,
            **model_kwargs,
        )

    max_length = min(c.max_length for c in stopping_criteria if type(c) is sc.MaxLengthCriteria)
    eos = [c for c in stopping_criteria if type(c) is sc.EosTokenCriteria]
    eos_ids = tuple(sorted({i for c in eos for i in _values(c.eos_token_id)}))
    pad = generation_config._pad_token_tensor
    # One static argument, keyed once (Note [Static values keyed once]).
    settings = Keyed(
        (
            _spec(logits_processor),
            _rules(logits_processor),
            eos_ids,
            None if pad is None or not eos_ids else _values(pad)[0],
            bool(generation_config.do_sample),
            tuple(sorted((k, v) for k, v in model_kwargs.items() if k not in _MODEL_KWARGS)),
        )
    )

    # Note [A module walked once within a block] in torchjax/compile/_state.py: between
    # the prefill's call and the loop's, only torchjax's glue and transformers' own
    # bookkeeping run, and calling the model runs its forward alone.
    quiet = calls_run_no_hooks(self) and type(self)._prefill is GenerationMixin._prefill
    with shared_walks() if quiet else contextlib.nullcontext():
        cache, tokens, done_at, length = _decode(
            self, input_ids, generation_config, model_kwargs, logits_processor, settings, max_length
        )
    # Note [Work behind the decode loop]
    whole = tokens[:, :length].clone() if length == max_length else None
    zero_ahead(cache)  # Note [A kept cache zeroed behind the decode loop] in _cache_state.py
    end = min(int(done_at), length)
    return whole if end == length and whole is not None else tokens[:, :end].clone()


def _decode(self, input_ids, generation_config, model_kwargs, processors, settings, max_length):
    """The prefill, the first token and the decode steps of ``device_sample``; returns the
    cache, the token buffer, the finish length (a tensor) and the length reached."""
    wrapper = vars(self)["forward"]
    prompt = input_ids.shape[1]
    outputs = self._prefill(input_ids, generation_config, model_kwargs)
    cache = outputs.get("cache")
    cache = model_kwargs["cache"] if cache is None else cache
    # The buffer spans the whole cache and one token more (the last one is never fed
    # back), the mask the cache: calls of another max_length that reuse the cache (Note
    # [Compiled generation with a static cache]) reuse the programs.
    room = cache_room(cache)
    size = room + 1
    step = wrapper.decode_step
    _LOCAL.processors = processors
    try:
        mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
        state = decode_state(wrapper, input_ids, mask, positions, room)
        # Note [The step after the prefill]: made once, before the first step.
        first = (wrapper.first_token, (*state, input_ids, outputs.logits, mask, positions))
        first += ({"settings": settings},)
        del outputs
        tokens, _, _, _, _, done_at, stopped = state
        length = prompt + 1
        loop = wrapper.loop
        while length < max_length:
            guard = Keyed(_python_state(cache))
            if loop:
                before = _python_state(cache, values=True)
                # Nothing in the cache's Python state moves per token: every step runs as
                # one program, up to the end or until every sequence finished. A step
                # not traced before is traced first, not run, so a step that leaves the
                # cache's Python state as it found it runs only inside the loop, and its
                # forward compiles once.
                ran = step.repeat(
                    max_length - length,
                    *state,
                    cache,
                    None,
                    settings=settings,
                    _torchjax_guard=guard,
                    until=stopped,
                    when=lambda g=guard, b=before: wrapper.after[("decode", g)] == b,
                    first=first,
                )
                first = None  # made, in the loop's program or on its own
                if ran:
                    # The loop ran to max_length, or stopped right after the step at
                    # which the last sequence finished, which set done_at to the next
                    # position: the length is min(done_at, max_length), read below.
                    length = max_length
                    break
            if first is not None:
                first[0](*first[1], **first[2])
                first = None
            step(*state, cache, None, settings=settings, _torchjax_guard=guard)
            _replay(cache, wrapper.after[("decode", guard)])
            length += 1
            if (length - prompt) % CHECK_EVERY == 0 and int(done_at) < size:
                break
        if first is not None:  # one new token: no decode step
            first[0](*first[1], **first[2])
    finally:
        _LOCAL.processors = None
    return cache, tokens, done_at, length


# Note [Work behind the decode loop]
# Once the decode loop is dispatched, the host reads the length at which every sequence
# had finished, which waits for the loop; what follows that read (the result's slice and
# copy, some 0.4 ms of host time on CPU, generate's return) is host time the device does
# not overlap. So the work the host can do without that length is dispatched before the
# read, behind the loop on the device: the result as it is when no sequence finished
# early (the buffer up to ``max_length``, copied), taken when the length says so (else
# dropped, and the shorter result copied after the read as before), and the reset of
# the kept cache for the next call (Note [A kept cache zeroed behind the decode loop]
# in _cache_state.py).


# generate reads its decoding method's signature every call: computed once.
device_sample.__signature__ = inspect.signature(device_sample)


def first_token(
    tokens, mask, pos, positions, unfinished, done_at, stopped, input_ids, logits, prompt_mask,
    prompt_positions, *, settings,
):  # fmt: skip
    """What ``torchjax.jit`` traces after the prefill (Note [The step after the prefill]):
    the decoding state written into the tensors the decode step carries (``decode_state``:
    the token buffer, the mask over the cache, the next write position, the next position
    ids, the unfinished flags, and the length at which every sequence had finished, the
    buffer's size while not yet, with its flag ``stopped``), and the first new token
    chosen from the prefill's ``logits``; in place."""
    batch, prompt = input_ids.shape
    room = tokens.shape[1] - 1
    # Fills in the program: no transfers of host values per call.
    tokens.fill_(logits.shape[-1])
    tokens[:, :prompt] = input_ids
    pos.fill_(prompt)
    unfinished.fill_(1)
    done_at.fill_(room + 1)
    stopped.zero_()
    if mask is not None:
        # Ones for the new tokens; cut to the cache's width when the prompt's mask and the
        # first new token pass it (one new token: the mask is never read).
        ones = prompt_mask.new_ones((batch, max(room - prompt_mask.shape[1], 1)))
        mask.copy_(torch.cat([prompt_mask, ones], dim=-1)[:, :room])
    if positions is not None:
        # the first new token's, as generate's update
        positions.copy_(prompt_positions[..., -1:] + 1)
    scores = logits[:, -1].to(torch.float32)
    _choose(settings, tokens, pos, scores, unfinished, done_at, stopped)


def decode_state(wrapper, input_ids, mask, positions, room: int) -> tuple:
    """The tensors the decode step carries, ``first_token``'s first seven arguments,
    kept per layout on the compiled forward ``wrapper`` (Note [The step after the
    prefill]): ``(tokens, mask, pos, positions, unfinished, done_at, stopped)``, the
    mask and position ids None where the call has none."""
    batch, device = input_ids.shape[0], input_ids.device
    # Written only by programs (an inference tensor's too, whatever the mode).
    key = (
        batch, room, input_ids.dtype, device,
        None if mask is None else mask.dtype,
        None if positions is None else (tuple(positions.shape[:-1]), positions.dtype),
    )  # fmt: skip
    states = wrapper.states
    state = states.pop(key, None)
    if state is None:

        def made(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=device)

        long = torch.long
        state = (
            made((batch, room + 1), input_ids.dtype),
            None if mask is None else made((batch, room), mask.dtype),
            made((), long),
            None if positions is None else made((*positions.shape[:-1], 1), positions.dtype),
            made((batch,), long),
            made((), long),
            made((), long),
        )
    states[key] = state  # the latest last
    while len(states) > KEEP_STATES:
        del states[next(iter(states))]
    return state


KEEP_STATES = 4  # decoding states kept per model (its static caches: KEEP_LAYOUTS)


# Note [The step after the prefill]
# Between the prefill and the decode loop, generate's bookkeeping (transformers'
# ``_update_model_kwargs_for_generation``: position ids and the mask grown by a token;
# here: the last logits in float32, the token buffer filled with the prompt, the mask
# widened to the cache, the next position ids, the flags) ran as eager ops, each a
# program of its own to compile on a first call (eight on a Llama), and the first new
# token was chosen by a further program. They are one program: ``first_token`` under
# ``torchjax.jit``, keyed by the shapes, the cache's length and the settings, so a later
# call of the same shapes reuses it. It reads the inputs transformers' update reads
# (only ``attention_mask`` and ``position_ids`` reach here: Note [Decode steps as one
# program]) and computes what the update and the first step computed. It writes the
# state in place, into tensors kept between calls of one layout (``decode_state``), so
# that on a warm call it runs inside the decode loop's program, before the loop (Note [A
# first call in the loop's program] in torchjax/compile/_repeat.py): one program call
# fewer between the prefill and the loop. The result is a copy out of the token buffer,
# so what a call returns never shares memory with the next call's state.


def decode_step(
    self,
    tokens,
    mask,
    pos,
    positions,
    unfinished,
    done_at,
    stopped,
    cache,
    logits,
    *,
    settings,
    _torchjax_guard,
):
    """What ``torchjax.jit`` traces: (with ``logits`` None) the forward of the token before
    ``pos`` over the cache, then the choice of the token at ``pos``; in place."""
    wrapper = vars(self)["forward"]
    if logits is None:
        last = tokens.gather(1, (pos - 1).reshape(1, 1).expand(tokens.shape[0], 1))
        inputs = self.prepare_inputs_for_generation(
            last,
            cache=cache,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **dict(settings.value[-1]),
        )
        out = wrapper.eager(**inputs, return_dict=True)
        logits = out.logits[:, -1].to(torch.float32)
        if positions is not None:
            positions.add_(1)
        wrapper.after[("decode", _torchjax_guard)] = _python_state(cache, values=True)
    _choose(settings, tokens, pos, logits, unfinished, done_at, stopped)


def _choose(settings, tokens, pos, logits, unfinished, done_at, stopped) -> None:
    """Processors, token choice, write at ``pos``, flags: transformers' ``_sample`` body."""
    _, rules, eos_ids, pad, do_sample, _ = settings.value
    scores = logits
    vocab = scores.shape[-1]
    for p, rule in zip(_LOCAL.processors, rules):
        if rule is None:
            scores = p(tokens, scores)
        elif rule[0] == "ngram":
            scores = _bar_repeated_ngrams(tokens, pos, rule[1], scores)
        else:
            _, start, least, ids = rule  # no EOS while pos - start < least
            # Made on the host: inside the trace these are constants, which an op on
            # the device would compute as a program of its own.
            is_eos = torch.isin(torch.arange(vocab), torch.tensor(ids)).to(scores.device)
            scores = torch.where(((pos - start) < least) & is_eos, -float("inf"), scores)
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        chosen = torch.multinomial(probs, num_samples=1).squeeze(1)
    else:
        chosen = torch.argmax(scores, dim=-1)
    if pad is not None:
        chosen = chosen * unfinished + pad * (1 - unfinished)
    chosen = chosen.to(tokens.dtype)  # index_copy_ takes only its own dtype, as on CPU
    tokens.index_copy_(1, pos.reshape(1), chosen[:, None])
    if eos_ids:
        hit = torch.isin(chosen, torch.tensor(eos_ids, device=chosen.device))
        unfinished.mul_((~hit).to(unfinished.dtype))
    first = (unfinished.max() == 0) & (done_at == tokens.shape[1])
    done_at.copy_(torch.where(first, pos + 1, done_at))
    stopped.copy_((done_at != tokens.shape[1]).to(stopped.dtype))
    pos.add_(1)


# Note [Repeated n-grams barred on the device]
# transformers' NoRepeatNGramLogitsProcessor reads the ids to the host (``tolist``), maps
# every n-gram's first n - 1 tokens to the tokens that followed them, and sets -inf at
# the tokens that followed the last n - 1 ids; nothing when fewer than n - 1 ids precede
# the new token (``cur_len + 1 < n``). Run as written it keeps generate out of the decode
# programs, and eagerly each token's ``scores[i, banned] = -inf`` has a new shape (a new
# program per count). Here the same set is found with fixed shapes over the token buffer:
# window i (tokens i .. i + n - 1) bars its last token when it lies wholly before ``pos``
# (i <= pos - n: none while fewer than n - 1 ids precede ``pos``) and its first n - 1
# tokens equal the n - 1 before ``pos``. Pad tokens of a left-padded prompt count, as
# they do in transformers. The barred positions are set to -inf exactly where
# transformers sets them, so the scores are equal.
def _bar_repeated_ngrams(tokens, pos, n: int, scores):
    """``scores`` with -inf at the tokens that would repeat an n-gram of ``tokens[:, :pos]``."""
    batch, size = tokens.shape
    vocab = scores.shape[-1]
    if size < n:
        return scores
    windows = tokens.unfold(1, n, 1)  # (B, W, n)
    steps = torch.arange(windows.shape[1], device=tokens.device)
    before = pos - (n - 1) + torch.arange(n - 1, device=tokens.device)
    last = tokens.gather(1, before.clamp(min=0).expand(batch, n - 1))  # (B, n - 1)
    seen = (windows[..., : n - 1] == last[:, None, :]).all(-1) & (steps <= pos - n)
    # Unbarred windows write into an extra column, dropped after.
    where = torch.where(seen, windows[..., -1].clamp(0, vocab), vocab)
    barred = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=scores.device)
    barred = barred.scatter(1, where, True)[:, :vocab]
    return scores.masked_fill(barred, -float("inf"))
