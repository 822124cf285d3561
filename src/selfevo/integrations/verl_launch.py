"""verl launch commands for one training phase: GRPO with the Search-R1 agent loop and selfevo's reward.

`phase_overrides` returns the Hydra overrides of `python -m verl.trainer.main_ppo` (verl 0.9's config
tree: `reward.custom_reward_function`, `actor_rollout_ref.rollout.multi_turn`, `…agent`); `phase_script`
writes them, with the checkpoint merge into a plain HF directory, as a shell script. The paper's
settings: on-policy (one update per batch, no KL), the sequence-mean-of-token-mean loss of Eq. (1),
`rollout.n` samples a prompt at temperature 0.8 / top-p 0.95, at most 5 assistant actions.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from selfevo.integrations.verl_search import AGENT_NAME, PARSER_NAME

REWARD_SHIM = '''"""verl loads its custom reward function from a file: this one re-exports selfevo's."""
from selfevo.integrations.rewards import compute_score, compute_score_batch  # noqa: F401
'''


@dataclass(frozen=True)
class VerlPhase:
    """What one verl job trains."""

    name: str  # e.g. r2-aux-0
    model: str  # HF directory to start from
    train_files: str  # parquet (datasets.write_verl)
    out: str  # HF directory to write (merged)
    ckpt_dir: str  # verl's checkpoint directory
    steps: int
    prompts_per_step: int
    n: int  # samples a prompt (GRPO group)
    lr: float
    tool_config: str  # "": no tool (a proposer that may not search)
    agent_loop_config: str
    reward_file: str
    settings: str = ""  # rewards.reward_settings JSON (proposer phases)
    max_prompt_length: int = 1024
    max_response_length: int = 2048  # all actions and observations of one trajectory
    max_actions: int = 5
    temperature: float = 0.8
    top_p: float = 0.95
    gpus: int = 8
    extra: Mapping[str, object] = field(default_factory=dict)  # more overrides (key -> value)


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def phase_overrides(p: VerlPhase) -> list[str]:
    # the method's settings are the engine's: an `extra` (an [engine.verl] table, refused there by name, or
    # a VerlPhase made by hand) may add settings and replace the free ones only
    if pinned := sorted(k for k in p.extra if pinned_verl(k)):
        raise ValueError(f"extra: {pinned[0]} is set by the engine from the run's config (the method's settings or "
                         "its bookkeeping); only these may be replaced: " + ", ".join(sorted(FREE_VERL)))
    o = {**_overrides(p), **p.extra}
    out = [f"{k}={_value(v)}" for k, v in o.items()]
    if p.settings:  # not in verl's schema: appended with "+"
        out.append(f"+{SETTINGS_KEY}={p.settings}")
    return out


SETTINGS_KEY = "reward.custom_reward_function.reward_kwargs.selfevo_settings"
# overrides an [engine.verl] table may replace: where the job logs, how long prompts are kept, the
# nodes and the rollout engine; every other one is the method's (Eq. (1), the group size, the reward) or
# the engine's bookkeeping (the step count its merge reads, the batch that makes one pass, the checkpoints)
FREE_VERL = frozenset({"trainer.logger", "trainer.project_name", "trainer.experiment_name",
                       "data.filter_overlong_prompts", "data.truncation", "trainer.nnodes",
                       "actor_rollout_ref.rollout.name"})


def pinned_verl(key: str) -> bool:
    """Does an [engine.verl] key replace (or reach below) an override the engine sets itself?"""
    key = key.lstrip("+")
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in _pinned())


@functools.cache
def _pinned() -> frozenset[str]:
    """The keys `phase_overrides` sets itself (those of any phase) but the free ones."""
    return (frozenset(_overrides(VerlPhase(*[""] * 5, 1, 1, 2, 0.0, *[""] * 3))) | {SETTINGS_KEY}) - FREE_VERL


def _overrides(p: VerlPhase) -> dict[str, object]:
    return {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "data.train_files": p.train_files,
        "data.val_files": p.train_files,
        "data.train_batch_size": p.prompts_per_step,
        "data.max_prompt_length": p.max_prompt_length,
        "data.max_response_length": p.max_response_length,
        "data.return_raw_chat": True,
        "data.filter_overlong_prompts": True,
        "data.truncation": "left",
        "actor_rollout_ref.model.path": p.model,
        "actor_rollout_ref.actor.optim.lr": p.lr,
        # paper Eq. (1): one on-policy update per batch, no KL, sequence mean of token means
        "actor_rollout_ref.actor.ppo_mini_batch_size": p.prompts_per_step,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.n": p.n,
        "actor_rollout_ref.rollout.temperature": p.temperature,
        "actor_rollout_ref.rollout.top_p": p.top_p,
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": p.max_actions,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": p.tool_config or "null",
        "actor_rollout_ref.rollout.multi_turn.format": PARSER_NAME,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": p.agent_loop_config,
        "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_NAME,
        "reward.custom_reward_function.path": p.reward_file,
        "reward.custom_reward_function.name": "compute_score",
        "trainer.n_gpus_per_node": p.gpus,
        "trainer.nnodes": 1,
        "trainer.total_training_steps": p.steps,
        "trainer.total_epochs": 1_000,  # the step count ends the job
        "trainer.save_freq": p.steps,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.default_local_dir": p.ckpt_dir,
        # a phase starts over (engine.py: verl's staged items carry no step to cut them at a
        # checkpoint); verl's default, auto, would go on from a killed attempt's checkpoint
        "trainer.resume_mode": "disable",
        "trainer.logger": ["console"],
        "trainer.project_name": "selfevo",
        "trainer.experiment_name": p.name,
    }


def train_command(p: VerlPhase) -> list[str]:
    return ["python3", "-m", "verl.trainer.main_ppo", *phase_overrides(p)]


def merge_command(p: VerlPhase) -> list[str]:
    return ["python3", "-m", "verl.model_merger", "merge", "--backend", "fsdp",
            "--local_dir", f"{p.ckpt_dir}/global_step_{p.steps}/actor", "--target_dir", p.out]


def phase_script(p: VerlPhase, path: str | Path, env: Mapping[str, str] | None = None) -> Path:
    """A shell script that trains the phase and merges its checkpoint (`set -euo pipefail`)."""
    from selfevo._io import atomic_writer

    lines = ["#!/usr/bin/env bash", f"# selfevo engine-run: verl phase {p.name}", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    lines += [f"rm -rf {shlex.quote(p.ckpt_dir)}",  # a killed attempt's checkpoints (the phase starts over)
              " \\\n    ".join(shlex.quote(a) for a in train_command(p)),
              " ".join(shlex.quote(a) for a in merge_command(p))]
    path = Path(path)
    with atomic_writer(path) as fh:
        fh.write("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def write_reward_shim(path: str | Path) -> Path:
    from selfevo._io import atomic_writer

    with atomic_writer(path) as fh:
        fh.write(REWARD_SHIM)
    return Path(path)
