"""vLLM generation for `LMPolicy` (`lm.generator = "vllm"`): the same base model, loaded a second
time inside a vLLM engine on the same GPU, serves the base model and every LoRA policy.

Training stays where it is (transformers + peft in `LMPolicy`); only `generate` moves. The engine
sees each policy as a `LoRARequest(name, int_id, adapter_dir)`. A policy's weights change on
`update`, on `new` (a fresh or copied adapter: a snapshot grader) and on `load`; `LMPolicy` counts
those changes in `revision[name]`. Before a policy next generates, its adapter is exported with
peft (`save_pretrained(dir, selected_adapters=[name])`) to a new versioned directory and served
under a new integer id, so vLLM loads the new weights instead of its cached copy of the old ones.
Exporting lazily, at the next generation, costs one save per change that is actually generated
from (a main-solver step, a frozen snapshot once), never one per update that nobody samples.

Everything else matches the transformers path so the rollout driver cannot tell the two apart:
- the prompt is `render(conversation) + prefix`, tokenized exactly as the HF path tokenizes it
  (`LMPolicy.prompt_ids`: no special tokens added; one over `lm.max_prompt_tokens` keeps its system
  prompt and question and loses its oldest turns after them);
- greedy is temperature 0; sampling is `lm.temperature` / `lm.top_p`, no top-k, like HF;
- the stop strings end an action and stay in its text (`include_stop_str_in_output`), the text is
  cut after the first one, and the prefix starts the returned text;
- finish_reason is "length" only when the token budget ran out before any stop.
Seeds differ in kind: HF seeds one torch generator per batch chunk, vLLM seeds each request
(`derive_seed(seed, "row", i)`), so a seeded sampled run is reproducible within one generator but
the two generators draw different samples. Greedy outputs agree up to kernel numerics.

The pure mapping functions (`sampling_kwargs`, `finish`, `max_lora_rank`; the prompt's ids: `rl.prompt_token_ids`)
import nothing heavy and are tested without vLLM.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from selfevo.agents.lm.config import LMConfig
from selfevo.agents.lm.protocol import STOP_STRINGS, cut_at_stop
from selfevo.loop.schedule import derive_seed

# the LoRA ranks vLLM accepts for max_lora_rank (vllm/config: possible_max_ranks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# ---------------------------------------------------------------- pure mappings


def check_vllm(cfg: LMConfig) -> None:
    """Raise a ValueError naming `lm.generator` when a vLLM engine cannot run here."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ValueError(f"lm.generator: \"vllm\" needs the vllm package, which cannot be imported here "
                         f"({e}); install it (pip install vllm) on a CUDA machine, or set "
                         f"lm.generator = \"hf\"") from None
    if cfg.device == "cpu":
        raise ValueError("lm.generator: \"vllm\" needs a CUDA GPU, but lm.device = \"cpu\"; "
                         "set lm.generator = \"hf\" for CPU runs")
    if cfg.device.startswith("cuda:") and cfg.device != "cuda:0":
        raise ValueError(f"lm.generator: vLLM uses the first visible GPU; instead of lm.device = "
                         f"\"{cfg.device}\" set CUDA_VISIBLE_DEVICES={cfg.device.split(':', 1)[1]} "
                         f"and lm.device = \"cuda\"")
    import torch

    if not torch.cuda.is_available():
        raise ValueError("lm.generator: \"vllm\" needs a CUDA GPU and torch sees none; "
                         "set lm.generator = \"hf\"")


def max_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds adapters of rank `r`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"lm.lora_r: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {r}")


def sampling_kwargs(cfg: LMConfig, *, greedy: bool, seed: int | None, row: int, max_tokens: int,
                    stops: Sequence[str] = STOP_STRINGS, n: int = 1) -> dict[str, Any]:
    """The `vllm.SamplingParams` of one request (row `row` of a `generate` call)."""
    kwargs: dict[str, Any] = {
        "n": n,
        "max_tokens": max_tokens,
        "stop": list(stops),
        "include_stop_str_in_output": True,  # the HF path keeps the stop string in the action
        "skip_special_tokens": True,  # as the HF path decodes
    }
    if greedy:
        kwargs.update(temperature=0.0, top_p=1.0)
    else:
        # no top-k, like the HF path's top_k=0 (vLLM's default disables it)
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p)
        if seed is not None:
            kwargs["seed"] = derive_seed(seed, "row", row) % 2**31
    return kwargs


def finish(head: str, text: str, finish_reason: str | None,
           stops: Sequence[str] = STOP_STRINGS) -> tuple[str, str]:
    """`(action text, finish_reason)` from one vLLM completion: the prefix `head` starts the text,
    which is cut after the first stop string; "length" only when the budget ran out first."""
    full = head + text
    cut = cut_at_stop(full, stops)
    stopped = cut != full or any(full.rstrip().endswith(s) for s in stops) or finish_reason != "length"
    return cut, "stop" if stopped else "length"


# ---------------------------------------------------------------- the engine


class VLLMEngine:
    """Generation for one `LMPolicy` through vLLM. `llm` is a ready `vllm.LLM`-like object (tests
    pass a stand-in); by default one is built for the policy's base model."""

    def __init__(self, policy, llm: Any | None = None, adapter_root: str | Path | None = None):
        self.policy = policy
        cfg: LMConfig = policy.cfg
        if cfg.adapter != "lora":
            raise ValueError("lm.generator: lm.generator=vllm needs lm.adapter=lora")
        self._tmp = None
        if adapter_root is None:  # exported adapters are transient: gone with the engine
            self._tmp = tempfile.TemporaryDirectory(prefix="selfevo-vllm-adapters-")
            adapter_root = self._tmp.name
        self.root = Path(adapter_root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._served: dict[str, tuple[int, Any, Path]] = {}  # name -> (revision, LoRARequest, dir)
        self._last_id = 0
        self.exports = 0  # adapters written (one per change that was generated from)
        if llm is None:
            llm = self._build_llm(cfg)
        self.llm = llm

    @staticmethod
    def _build_llm(cfg: LMConfig):
        check_vllm(cfg)
        from vllm import LLM

        from selfevo.agents.lm.policy import resolve_model

        path = resolve_model(cfg.model)
        return LLM(model=path, tokenizer=path, dtype=cfg.dtype, seed=0,
                   enable_lora=True, max_lora_rank=max_lora_rank(cfg.lora_r),
                   max_loras=1,  # one policy per generate call; others wait in vLLM's CPU cache
                   gpu_memory_utilization=cfg.vllm_gpu_memory,
                   max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens)

    @property
    def max_model_len(self) -> int:
        cfg = self.policy.cfg
        return cfg.max_prompt_tokens + cfg.max_new_tokens

    def lora_request(self, name: str):
        """The LoRARequest serving policy `name` as it is now (exported again after a change)."""
        revision = self.policy.revision.get(name, 0)
        served = self._served.get(name)
        if served is not None and served[0] == revision:
            return served[1]
        from vllm.lora.request import LoRARequest

        self._last_id += 1
        out = self.root / f"{self._last_id:06d}"
        self.policy.peft.save_pretrained(str(out), selected_adapters=[name], save_embedding_layers=False)
        path = out / name  # peft writes a named (non-default) adapter into a subdirectory
        request = LoRARequest(f"{name}#{self._last_id}", self._last_id, str(path))
        self._served[name] = (revision, request, out)
        self.exports += 1
        if served is not None:  # the old version is never requested again
            shutil.rmtree(served[2], ignore_errors=True)
        return request

    def generate(self, name: str | None, conversations: Sequence[Sequence[dict]], *, greedy: bool,
                 seed: int | None, max_new_tokens: int | None = None,
                 stops: Sequence[str] = STOP_STRINGS, prefix: str | Sequence[str] = "") -> list[tuple[str, str]]:
        """`LMPolicy.generate` through vLLM (same arguments, same results' form)."""
        if not conversations:
            return []
        cfg = self.policy.cfg
        # the engine's context is sized for lm.max_new_tokens: a larger budget is capped
        budget = min(max_new_tokens or cfg.max_new_tokens, cfg.max_new_tokens)
        heads = [prefix] * len(conversations) if isinstance(prefix, str) else list(prefix)
        ids = self.policy.prompt_ids(conversations, heads)
        from vllm import SamplingParams

        params = [SamplingParams(**sampling_kwargs(cfg, greedy=greedy, seed=seed, row=i, max_tokens=budget,
                                                   stops=stops)) for i in range(len(ids))]
        lora = None if name is None else self.lora_request(name)
        outputs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params,
                                    lora_request=lora, use_tqdm=False)
        return [finish(h, o.outputs[0].text, o.outputs[0].finish_reason, stops) for h, o in zip(heads, outputs)]

    def close(self) -> None:
        self._served.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
