"""The language-model backend's settings (the `[lm]` table of a run config). No torch here: a
config is parsed and checked before anything heavy is imported."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from selfevo._io import absolute, is_path


@dataclass(frozen=True)
class LMConfig:
    model: str = "smollm2-135m"  # smollm2-135m (shipped, offline) | a local directory | a hub id
    adapter: str = "lora"  # lora: every policy a LoRA adapter on one frozen base | full: full fine-tuning
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float = 1e-5  # AdamW
    max_grad_norm: float = 1.0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 | float16
    threads: int = 0  # torch CPU threads (0: torch's default)
    max_actions: int = 5  # paper: at most 5 assistant actions a trajectory
    max_new_tokens: int = 512  # paper: at most 512 new tokens an action
    max_prompt_tokens: int = 4096  # a longer prompt keeps its system prompt and question, cut after them
    max_train_tokens: int = 4096  # a longer sequence is cut when training
    temperature: float = 0.8  # paper: grader and rollout sampling at temperature 0.8, top-p 0.95
    top_p: float = 0.95
    doc_tokens: int = 256  # Dr. Zero: the proposer sees the first 256 tokens of its source
    proposer_search: bool = True  # the proposer may search before writing its question
    # small models rarely write the tags unprompted: with the scaffold the proposer's reply is
    # written in two forced-prefix parts, "<question>" ... and "</question> <answer>" ... (no search)
    proposer_scaffold: bool = False
    format_penalty: float = 0.5  # reward of a proposal that breaks the format rules: -format_penalty
    gen_batch: int = 32  # rows generated together
    # the default audit judge on a real corpus (the base model served on loopback, evolve.py):
    # tokens one of its replies may use
    judge_max_tokens: int = 256
    train_batch: int = 4  # sequences per forward/backward micro-batch
    # hf: transformers' generate (any device) | vllm: a vLLM engine on the same GPU serves the base
    # model and every LoRA policy (agents/lm/vllm_engine.py); training stays with transformers
    generator: str = "hf"
    vllm_gpu_memory: float = 0.45  # share of the GPU vLLM may take (weights + KV cache); the rest trains

    def __post_init__(self):
        if not self.model.strip():
            raise ValueError("lm.model: name a model (smollm2-135m, a local directory or a hub id)")
        if is_path(self.model):
            # absolute: a run resumed, audited or replayed from another directory (or on a Ray worker)
            # must load the same model (a hub id or the shipped name is no path)
            object.__setattr__(self, "model", absolute(self.model, "lm.model"))
        if self.adapter not in ("lora", "full"):
            raise ValueError(f"lm.adapter: must be lora or full, got {self.adapter!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"lm.dtype: must be float32, bfloat16 or float16, got {self.dtype!r}")
        # "cuda0" or "cuda:x" passed a prefix test here and was a torch traceback on a GPU machine
        if not (self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"lm.device: must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        counts = ("lora_r", "lora_alpha", "max_actions", "max_new_tokens", "max_prompt_tokens", "max_train_tokens",
                  "doc_tokens", "gen_batch", "train_batch", "judge_max_tokens")
        for name, least in (*((c, 1) for c in counts), ("threads", 0)):
            value = getattr(self, name)
            # load_config checks types; a Python caller's 2.5 or True would pass the bound below
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"lm.{name}: must be an integer, got {value!r}")
            if value < least:
                raise ValueError(f"lm.{name}: must be >= {least}, got {value}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lm.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        # written as ranges so that nan (every comparison false) and inf are refused too: a config file
        # cannot hold them (load_config refuses them), a Python caller can
        for name in ("lr", "max_grad_norm"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"lm.{name}: must be a finite number > 0, got {getattr(self, name)}")
        if not 0 < self.temperature <= 2:
            raise ValueError(f"lm.temperature: must be in (0, 2], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"lm.top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.format_penalty < math.inf:
            raise ValueError(f"lm.format_penalty: must be a finite number >= 0, got {self.format_penalty}")
        if not self.lora_targets:
            raise ValueError("lm.lora_targets: name at least one module")
        if self.generator not in ("hf", "vllm"):
            raise ValueError(f"lm.generator: must be hf or vllm, got {self.generator!r}")
        if self.generator == "vllm" and self.adapter != "lora":
            # vLLM serves LoRA adapters over one loaded base; a fully fine-tuned copy per policy
            # would need the engine's weights reloaded after every update
            raise ValueError("lm.generator: lm.generator=vllm needs lm.adapter=lora")
        if self.generator == "vllm":
            from selfevo.agents.lm.vllm_engine import max_lora_rank

            max_lora_rank(self.lora_r)  # refused here, not when the engine starts on the GPU
        if self.adapter == "full":
            # a LoRA setting would be recorded in config.json and never used
            default = LMConfig.__dataclass_fields__
            for f in fields(self):
                if f.name.startswith("lora_") and getattr(self, f.name) != default[f.name].default:
                    raise ValueError(f"lm.{f.name}: a LoRA setting, and lm.adapter = \"full\" trains no adapter")
        if not 0 < self.vllm_gpu_memory < 1:
            raise ValueError(f"lm.vllm_gpu_memory: must be in (0, 1), got {self.vllm_gpu_memory}")

    @property
    def proposer_searches(self) -> bool:
        """Whether the proposer may search (and its prompt offers the tool): the scaffold writes its
        reply at once, whatever proposer_search says."""
        return self.proposer_search and not self.proposer_scaffold
