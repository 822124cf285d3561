"""One TRL training job: GRPO on a lineage-carrying dataset with selfevo's rollout and reward.

A job is a JSON file the orchestrator writes (`engine.py`), so the same job runs in process on a
CPU or under a launcher on many GPUs:

    python -m selfevo.integrations.trl_job JOB.json
    accelerate launch --config_file configs/trl-accelerate-6gpu.yaml -m selfevo.integrations.trl_job JOB.json

Job fields: kind (proposer | solver), model (HF directory to start from), out (HF directory to write:
a LoRA adapter is merged into its base), rows (JSONL of `datasets.py` rows: steps × prompts_per_step
of them, one pass, `datasets.one_pass`), steps (optimizer steps), prompts_per_step, processes (the
data-parallel processes it was written for; the launcher must start that many), generations (GRPO
group size), lr, max_grad_norm, seed, lora ({r, alpha, dropout, targets} or null: full
fine-tuning), rollout (`trl_env.SearchRollout` fields), search
({retriever_url} or, in process only, the caller's tool), reward (proposer: `rewards.FrontierReward`
fields with graders; solver: records path, round, step numbering, identity), grpo (extra GRPOConfig
fields: bf16, gradient_checkpointing, use_vllm, vllm_mode, ...), dtype, device, threads, save_steps
(checkpoint every N steps; 0: never), resume_from and start_step (`resume` sets them).

A killed job is continued by `resume(job)`: from its newest checkpoint, the rows it staged for the
steps before it kept and those after it dropped (they are trained and staged again); TRL restores
the weights, optimizer, schedule, step and random state, and skips the batches already trained on.

Departures from the loop's own trainer (`agents/lm/policy.py`), all TRL's: advantages are normalised
within each prompt's group of completions (the proposer's group shares its document and hop count,
so it sits inside one hop bucket), the optimizer state starts fresh every round, and TRL's sampler
draws each step's batch (the loop splits the admitted pool in order; equal batches need a few rows
drawn twice, `datasets.one_pass`).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from selfevo._io import read_json
from selfevo.search.tool import SearchTool


def _rows(path: str, fields: Sequence[str] = ()) -> list[dict]:
    """The job's training rows, read with the one checking JSONL reader (`corpus.iter_json_lines`): a
    damaged line is a DataError naming file and line; none is dropped (a log reader's torn-tail rule
    would silently train on fewer rows). A row without one of `fields` is a DataError naming its line
    too (the dataset would otherwise fail later with a bare KeyError naming neither file nor line)."""
    from selfevo.corpus import DataError, iter_json_lines

    rows = []
    for lineno, row in iter_json_lines(path):
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(path, lineno, f"missing field(s) {', '.join(repr(f) for f in missing)} (a training row is "
                                          f"a prompt and its lineage: {', '.join(fields)}; `datasets.py` writes them)")
        rows.append(row)
    return rows


def job_tool(job: dict, tool: SearchTool | None = None) -> SearchTool:
    s = job["search"]
    if tool is not None:
        return tool
    if not s.get("retriever_url"):
        raise ValueError("trl job: run in its own process, it needs search.retriever_url (a /retrieve server)")
    from selfevo.search.client import RetrieverClient

    return SearchTool(RetrieverClient(s["retriever_url"]), topk=s.get("topk", 3), max_calls=s.get("max_calls", 5))


def trainer_dir(out: str | os.PathLike) -> Path:
    """Where TRL writes a job's checkpoints (beside its output). They outlive the saved output: a kill
    after the save but before the engine logs the phase resumes from the last one (no update left,
    the output saved again) instead of training the phase again; the engine removes them once the
    phase is logged (`engine.EngineRun.phase`)."""
    return Path(out).parent / f".trainer-{Path(out).name}"


def last_checkpoint(out: str | os.PathLike) -> tuple[Path | None, int]:
    """The newest whole checkpoint of the job writing `out`, and its step; (None, 0) without one.
    A checkpoint is whole once its trainer_state.json parses: HF writes that file after the
    weights, optimizer and random state, so a kill mid-save leaves one that is passed over."""
    best: tuple[Path | None, int] = (None, 0)
    d = trainer_dir(out)
    for p in d.iterdir() if d.is_dir() else ():
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and int(m[1]) > best[1]:
            try:
                best = (p, int(read_json(p / "trainer_state.json")["global_step"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return best


def resume(job: dict) -> dict:
    """The job as a (re)start runs it: with `save_steps`, from the newest whole checkpoint a killed
    attempt left, keeping what that attempt staged for the steps before it; otherwise from step 1,
    with nothing staged and no stale checkpoint. Run it once, before the job's processes start."""
    from selfevo.integrations.admit import trim_staged

    ckpt, step = last_checkpoint(job["out"]) if job.get("save_steps") else (None, 0)
    if ckpt is None:
        shutil.rmtree(trainer_dir(job["out"]), ignore_errors=True)
    trim_staged(job["reward"], step)
    return {**job, "resume_from": str(ckpt) if ckpt else None, "start_step": step}


def grpo_fields() -> frozenset[str] | None:
    """The fields GRPOConfig takes (what `[engine.trl]` may set); None when trl is not installed."""
    import dataclasses

    try:
        from trl import GRPOConfig
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(GRPOConfig) if f.init)


# GRPOConfig fields the job sets itself, and why `[engine.trl]` may not: the rewards count their calls
# as updates (TRL calls them once a generation batch, so one batch must be one optimizer step), a job
# is one pass over exactly steps × prompts rows, and the rest follow a setting selfevo has already.
PINNED_GRPO = {
    **dict.fromkeys(("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size"),
                    "the job pins one generation batch to one optimizer step (the rewards count each call as "
                    "a proposer or solver step)"),
    "num_iterations": "pinned to 1: paper Eq. (1) is on-policy, one update per generation batch",
    "per_device_train_batch_size": "set from the prompts a step (engine.proposer_prompts, or the admitted pool "
                                   "over loop.solver_steps) × the group size, split over engine.train_processes",
    "auto_find_batch_size": "it would change the batch a step, which the job sets (one pass of steps × prompts)",
    "max_steps": "set from loop.proposer_steps / loop.solver_steps (and the aux budget)",
    "num_generations": "set from engine.proposer_generations / engine.solver_generations",
    "learning_rate": "set from lm.lr",
    "max_grad_norm": "set from lm.max_grad_norm",
    "seed": "set from the run's seed",
    "max_completion_length": "set from lm.max_new_tokens",
    "temperature": "set from lm.temperature (the rollout samples at it; TRL scales the logits by it)",
    "top_p": "set from lm.top_p",
    "beta": "pinned to 0: paper Eq. (1) has no KL term",
    "loss_type": 'pinned to "grpo": paper Eq. (1), the sequence mean of token means',
    "use_cpu": "set from lm.device",
    "remove_unused_columns": "pinned to false: the lineage columns must reach the rewards",
    **dict.fromkeys(("output_dir", "save_strategy", "save_steps", "save_total_limit"),
                    "set from engine.save_steps (a resumed phase looks for its checkpoints there)"),
    # a resumed phase must end as a phase never killed: the batches trained skipped, the optimizer restored
    "ignore_data_skip": "pinned to false: a resumed phase skips the batches it trained before the kill",
    "save_only_model": "pinned to false: a resumed phase restores the optimizer's state from its checkpoint",
}


# GRPOConfig fields that say where and how a job reports, not what it trains
TRL_LOGGING = frozenset({"run_name", "report_to", "logging_dir", "logging_steps", "logging_strategy",
                         "logging_first_step", "log_level", "log_completions", "disable_tqdm", "project"})


def grpo_args(job: dict, world_size: int = 1):
    from trl import GRPOConfig

    g = job["generations"]
    per_step = job["prompts_per_step"] * g
    if per_step % world_size:
        raise ValueError(f"trl job: {per_step} completions a step do not split over {world_size} processes")
    extra = dict(job.get("grpo") or {})
    pinned = sorted(set(extra) & set(PINNED_GRPO))
    if pinned:  # engine.py refuses them when the config is read; a hand-written job is checked here
        raise ValueError(f"trl job: grpo.{pinned[0]}: {PINNED_GRPO[pinned[0]]}")
    vllm = bool(extra.get("use_vllm"))
    if vllm:  # the rollout stops at each action's end (trl_env._vllm_generate)
        extra.setdefault("vllm_mode", "colocate")
        extra["generation_kwargs"] = {"stop": ["</search>", "</answer>"], "include_stop_str_in_output": True,
                                      **(extra.get("generation_kwargs") or {})}
    cpu = job.get("device", "cpu") == "cpu"
    dtype = job.get("dtype", "float32")
    save = ({"save_strategy": "steps", "save_steps": job["save_steps"], "save_total_limit": 1}  # `resume` uses it
            if job.get("save_steps") else {"save_strategy": "no"})
    kwargs = dict(output_dir=str(trainer_dir(job["out"])), **save,
                  per_device_train_batch_size=per_step // world_size, num_generations=g,
                  max_steps=job["steps"], learning_rate=job["lr"], max_grad_norm=job.get("max_grad_norm", 1.0),
                  # paper Eq. (1): on-policy, sequence-normalised policy gradient, no KL term
                  beta=0.0, num_iterations=1, steps_per_generation=1, gradient_accumulation_steps=1,
                  loss_type="grpo", max_completion_length=job["rollout"].get("max_new_tokens", 512),
                  temperature=job["rollout"].get("temperature", 0.8), top_p=job["rollout"].get("top_p", 0.95),
                  logging_steps=1, report_to=[], seed=job.get("seed", 0) % 2**31,
                  use_cpu=cpu, dataloader_num_workers=0, remove_unused_columns=False,
                  model_init_kwargs={"dtype": dtype},
                  # mixed precision follows the job's dtype: TRL's own default (bf16 autocast) would
                  # train a float32 job in bfloat16, which a CPU without bf16 units runs several times slower
                  bf16=dtype == "bfloat16", fp16=dtype == "float16")
    kwargs.update(extra)
    return GRPOConfig(**kwargs)


def run_job(job: dict, tool: SearchTool | None = None) -> dict:
    """Train, save the model to `job["out"]`; return {steps, completions, graded, seconds}."""
    import time

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl import GRPOTrainer

    from selfevo.integrations.datasets import LINEAGE, to_trl
    from selfevo.integrations.rewards import FrontierReward, TRLFrontierReward, TRLSolverReward
    from selfevo.integrations.routing import Grader
    from selfevo.integrations.trl_env import SearchRollout
    from selfevo.loop.folds import FoldAssignment

    started = time.perf_counter()
    if job.get("threads"):  # on a busy CPU one thread avoids OpenMP oversubscription
        torch.set_num_threads(int(job["threads"]))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != job.get("processes", world_size):
        # the process index seeds sampling and names proposer items, and a checkpoint holds one random
        # state a process: another count computes another run
        raise ValueError(f"trl job: written for {job['processes']} training processes (engine.train_processes), "
                         f"launched as {world_size}; make the launcher start {job['processes']}")
    tool = job_tool(job, tool)
    rows = _rows(job["rows"], ("prompt", *LINEAGE))  # what `to_trl` and the rewards read of each row
    if len(rows) != job["steps"] * job["prompts_per_step"]:
        raise ValueError(f"trl job: {job['rows']} has {len(rows)} rows; a job trains one pass of {job['steps']} "
                         f"steps × {job['prompts_per_step']} prompts (datasets.one_pass)")
    r = job["reward"]
    closer = None
    if job["kind"] == "proposer":
        frontier = FrontierReward(treatment=r["treatment"], round=r["round"],
                                  folds=FoldAssignment.from_json(r["folds"]),
                                  graders={g["role"]: Grader.from_json(g) for g in r["graders"]}, tool=tool,
                                  items_path=r["items_path"], samples=r.get("samples", 5),
                                  format_penalty=r.get("format_penalty", 0.5), seed=r.get("seed", 0),
                                  step_base=r.get("step_base", 0), remote=r.get("remote"))
        reward, closer = TRLFrontierReward(frontier), frontier.close
    else:
        reward = TRLSolverReward(r.get("records_path"), round=r["round"], step_base=r.get("step_base", 0),
                                 first_step_in_round=r.get("first_step_in_round", 1), grader=r.get("grader"))
    rollout = SearchRollout(tool, role=job["kind"], seed=job.get("seed", 0), **job["rollout"])
    # a resumed job's first call is the step after its checkpoint: step numbers and sampling seeds
    # go on as an uninterrupted job's would
    reward.calls = rollout.calls = job.get("start_step", 0)
    peft_config = None
    if job.get("lora"):
        from peft import LoraConfig

        lo = job["lora"]
        peft_config = LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=lo.get("dropout", 0.0),
                                 target_modules=list(lo["targets"]), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=job["model"], reward_funcs=[reward], args=grpo_args(job, world_size),
                          train_dataset=to_trl(rows), rollout_func=rollout, peft_config=peft_config,
                          callbacks=[_save_as_the_job_says()])
    try:
        trainer.train(resume_from_checkpoint=job.get("resume_from"))
    finally:
        if closer:
            closer()
    _save(trainer, job)
    steps = int(trainer.state.global_step)
    return {"steps": steps, "completions": steps * job["prompts_per_step"] * job["generations"],
            "seconds": round(time.perf_counter() - started, 3)}


def _save_as_the_job_says():
    from transformers import TrainerCallback

    class SaveAsTheJobSays(TrainerCallback):
        """HF restores `save_steps` from a checkpoint's trainer_state.json: a phase resumed with
        another engine.save_steps would checkpoint as before. The job's setting wins."""

        def on_train_begin(self, args, state, control, **kwargs):
            state.save_steps = args.save_steps

    return SaveAsTheJobSays()


def _save(trainer, job: dict) -> None:
    """Write the trained policy as a plain HF directory (a LoRA adapter merged into its base), so
    every consumer -- the next round, a grader server, vLLM -- loads it the same way."""
    out = Path(job["out"])
    tmp = out.parent / f".{out.name}.tmp"
    if trainer.accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    if job.get("lora"):
        adapter = out.parent / f".{out.name}.adapter"
        trainer.save_model(str(adapter))
        if trainer.accelerator.is_main_process:
            import torch
            from peft import AutoPeftModelForCausalLM

            merged = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=getattr(torch, job.get("dtype",
                                                                                                 "float32")))
            merged.merge_and_unload().save_pretrained(str(tmp))
            shutil.rmtree(adapter, ignore_errors=True)
    else:
        trainer.save_model(str(tmp))
    if trainer.accelerator.is_main_process:
        trainer.processing_class.save_pretrained(str(tmp))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    trainer.accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m selfevo.integrations.trl_job JOB.json", file=sys.stderr)
        return 2
    job = read_json(args[0])
    result = run_job(job)
    if int(os.environ.get("RANK", "0")) == 0:
        from selfevo._io import write_json

        write_json(Path(args[0]).with_suffix(".result.json"), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
