"""The Search-R1 search environment for TRL's GRPOTrainer, as a `rollout_func`.

TRL's built-in tool loop (`tools=` / `environment_factory=`) parses the chat template's JSON tool
calls; the Search-R1 protocol is text tags (`<search>`, `<information>`, `<answer>`), which every
selfevo agent speaks. So the rollout is selfevo's one multi-turn driver (`agents.lm.rollout.run_rollouts`)
over the trainer's own model, and TRL gets back, per completion:

    prompt_ids      the system + user turns, rendered with the chat template
    completion_ids  every later token: assistant actions, <information> observations, corrections
                    (one sequence a trajectory: the chat rendered append-only, `rl.append_only`, each
                    action verbatim after the text it was generated from, so that any chat template
                    works, Qwen3's, which re-renders earlier turns, included)
    env_mask        1 on tokens the policy wrote, 0 on observations and template tokens, so tool text
                    is never trained (TRL multiplies it into the loss mask); the proposer's final
                    <answer> span is 0 too (`rl.trained_spans(mask_final_answer=True)`)
    logprobs        None (sampled by the model being trained: TRL computes them itself)
    answer / final / read   forwarded to the reward functions (the extracted answer; the last action;
                    the pages the searches returned -- the proposal's lineage)

Generation: `hf` runs `generate` on the unwrapped training model (any device, CPU included);
`vllm` uses TRL's colocated vLLM engine (GRPOConfig use_vllm=True, vllm_mode="colocate"; each
process generates its own rows, so turns need no collective). The proposer scaffold (two forced-prefix
parts, for models too small to write the tags unprompted) needs `hf`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from selfevo.agents.lm.model import plain_generation_config
from selfevo.agents.lm.protocol import STOP_STRINGS, cut_at_stop, parse_action, parse_proposer_action, scaffolded
from selfevo.agents.lm.rl import Render, append_only, template_of, token_mask, trained_spans
from selfevo.agents.lm.rollout import Rollout, run_rollouts
from selfevo.loop.schedule import derive_seed
from selfevo.search.tool import SearchTool


@dataclass
class SearchRollout:
    """`rollout_func(prompts, trainer) -> dict` for GRPOTrainer (see the module docstring)."""

    tool: SearchTool
    role: str = "solver"  # solver | proposer
    max_actions: int = 5  # paper: at most 5 assistant actions
    max_new_tokens: int = 512  # paper: at most 512 new tokens an action
    max_tokens: int = 4096  # a longer completion is cut (training length)
    temperature: float = 0.8
    top_p: float = 0.95
    scaffold: bool = False  # proposer: the forced-prefix scaffold (no search)
    search: bool = True  # proposer: may search before writing
    backend: str = "hf"  # hf | vllm
    seed: int = 0

    def __post_init__(self):
        if self.role not in ("solver", "proposer"):
            raise ValueError(f"SearchRollout.role: solver or proposer, got {self.role!r}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"SearchRollout.backend: hf or vllm, got {self.backend!r}")
        if self.scaffold and self.backend != "hf":
            raise ValueError("SearchRollout: the proposer scaffold needs backend='hf'")
        self.calls = 0

    # ------------------------------------------------------------ TRL entry point
    def __call__(self, prompts: Sequence[list[dict]], trainer) -> dict:
        tokenizer = trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        process = getattr(trainer.accelerator, "process_index", 0)
        seed = derive_seed(self.seed, self.role, trainer.state.global_step, self.calls, process)
        self.calls += 1
        # what each action is generated from, and trained on (GRPOConfig.chat_template_kwargs, as TRL's own
        # generation passes them: enable_thinking=False, say)
        render = append_only(template_of(tokenizer, **(getattr(trainer.args, "chat_template_kwargs", None) or {})))
        gen = self._generator(trainer, tokenizer, render)
        rollouts = self.rollouts([list(p) for p in prompts], gen, seed)
        return self.encode(tokenizer, prompts, rollouts, render)

    def rollouts(self, starts: list[list[dict]], gen, seed: int) -> list[Rollout]:
        solver = self.role == "solver"
        searching = solver or (self.search and not self.scaffold)
        generate = gen if solver or not self.scaffold else scaffolded(gen)
        return run_rollouts(starts, self.tool, generate, max_actions=self.max_actions if searching else 1,
                            seed=seed, parse=parse_action if solver else parse_proposer_action)

    def encode(self, tokenizer, prompts: Sequence[list[dict]], rollouts: Sequence[Rollout],
               render: append_only | None = None) -> dict:
        render = render or append_only(template_of(tokenizer))
        final = self.role == "proposer"
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": [], "answer": [],
               "final": [], "read": []}
        eos = tokenizer.eos_token_id
        for _, ro in zip(prompts, rollouts, strict=True):
            # a rollout the backend failed before any action is its prompt as generation rendered it
            acted = any(m["role"] == "assistant" for m in ro.messages)
            text, spans = render(ro.messages, not acted), render.spans(ro.messages)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            mask = token_mask(enc["offset_mapping"], trained_spans(ro.messages, spans, final))
            # the prompt: the tokens before the first reply (the assistant header the template writes included)
            first = next((a for (a, _), m in zip(spans, ro.messages) if m["role"] == "assistant"), len(text))
            cut = sum(1 for _, e in enc["offset_mapping"] if e <= first)
            comp, env = ids[cut:], mask[cut:]
            if ro.messages[-1]["role"] == "assistant" and eos in comp:  # end at the last action's end of turn
                last = len(comp) - 1 - comp[::-1].index(eos)
                comp, env = comp[:last + 1], env[:last + 1]
            if not comp:  # the backend failed before any action: one end-of-turn token, not trained
                comp, env = [eos], [0]
            out["prompt_ids"].append(ids[:cut])
            out["completion_ids"].append(comp[:self.max_tokens])
            out["env_mask"].append(env[:self.max_tokens])
            out["answer"].append(ro.answer)
            out["final"].append(ro.final)
            out["read"].append(list(dict.fromkeys(ro.read)))
        return out

    # ------------------------------------------------------------ generation
    def _generator(self, trainer, tokenizer, render: Render):
        if self.backend == "vllm":
            return lambda convs, seed, prefix=None, stops=STOP_STRINGS: _vllm_generate(
                trainer, tokenizer, convs, render)
        return lambda convs, seed, prefix=None, stops=STOP_STRINGS: hf_generate(
            trainer, tokenizer, convs, seed=seed, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_p=self.top_p, stops=stops, prefix=prefix, render=render)


def hf_generate(trainer, tokenizer, conversations: Sequence[Sequence[dict]], *, seed: int | None,
                max_new_tokens: int, temperature: float, top_p: float, stops: Sequence[str] = STOP_STRINGS,
                prefix: Sequence[str] | None = None, render: Render) -> list[tuple[str, str]]:
    """One sampled assistant action per conversation with the trainer's model: `(text, finish_reason)`,
    cut after the first stop string; `prefix[i]` starts reply i and is part of its text. `render`:
    the conversation as the action is generated from it (`rl.append_only`)."""
    import torch
    from trl.models.utils import unwrap_model_for_generation

    texts = [render([dict(m) for m in c], True) + (prefix[i] if prefix else "") for i, c in enumerate(conversations)]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model, torch.no_grad():
        enc = enc.to(model.device)
        if seed is not None:
            torch.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        was_training = model.training
        model.eval()
        # as `load_pretrained` does for every other model: the policy's generation_config.json (a
        # repetition_penalty, a min_p) would otherwise shape the samples it is trained on
        model.generation_config = plain_generation_config(model.generation_config)
        try:
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=None, pad_token_id=pad, stop_strings=list(stops),
                                 tokenizer=tokenizer)
        finally:
            model.train(was_training)
    replies = []
    width = enc["input_ids"].shape[1]
    for i, row in enumerate(out):
        new = row[width:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        text = (prefix[i] if prefix else "") + text
        cut = cut_at_stop(text, stops)
        eos = tokenizer.eos_token_id
        stopped = cut != text or any(text.endswith(s) for s in stops) or bool((new == eos).any())
        replies.append((cut, "stop" if stopped or len(new) < max_new_tokens else "length"))
    return replies


def _vllm_generate(trainer, tokenizer, conversations: Sequence[Sequence[dict]],
                   render: Render) -> list[tuple[str, str]]:
    """One action per conversation with TRL's colocated vLLM engine (stop strings come from
    GRPOConfig.generation_kwargs, which `engine.py` sets: stop=</search>,</answer>, kept in the output)."""
    ids = [tokenizer(render([dict(m) for m in c], True), add_special_tokens=False)["input_ids"] for c in conversations]
    _, completion_ids, _, _ = trainer.vllm_generation.generate(prompts=ids, images=None, num_generations=1)
    replies = []
    for comp in completion_ids:
        text = tokenizer.decode(comp, skip_special_tokens=True)
        cut = cut_at_stop(text)
        replies.append((cut, "stop" if cut != text or any(text.endswith(s) for s in STOP_STRINGS)
                        or (comp and comp[-1] == tokenizer.eos_token_id) else "length"))
    return replies
