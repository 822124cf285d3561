"""CrossFit, MSV and the audit inside existing RL engines (TRL, verl).

selfevo supplies the provenance layer; the engine does the distributed training:

    datasets.py     lineage-carrying proposer prompts and solver training sets (TRL `datasets`,
                    verl / Search-R1 parquet), split by fold for the auxiliary solvers
    routing.py      which served grader may grade a question: a query over lineage
    rewards.py      the frontier reward and the solver reward in TRL's and verl's calling conventions;
                    the proposer reward grades through OpenAI-compatible endpoints and logs every item
    admit.py        admission (every well-formed proposal, or MSV) between proposal generation and
                    solver training; writes the proposer step records the audit reads
    trl_env.py      the Search-R1 multi-turn rollout as a TRL `rollout_func` (observations masked)
    verl_search.py  the Search-R1 search tool, tool-call parser and agent loop for verl, and their configs
    engine.py       `selfevo engine-run`: the rounds as engine jobs, resumable at phase granularity

Nothing here changes the method: the matcher (`evaluate.answers_match`), the frontier reward
(`algos.frontier_reward`), the folds (`loop.folds`), MSV (`loop.admission.MSV`) and the record
schema (`loop.engine`) are the loop's own. See docs/integrations.md.
"""
