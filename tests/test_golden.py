"""Golden numbers (torchtune-style): one small run of every treatment on a fixed seed, pinned.

Any change to the loop, the sim learners, the world, the rules, the audit or the evaluation that
moves a number here is a change of results: if it is meant, rerun the benchmarks whose numbers it
moves (docs/results.md) and update these values from the same command; if it is not, it is a bug.
The values were produced by this test's own schedule at commit a326e0d (before the refactors of
2026-12-01, which had to leave every one of them unchanged). Metrics are ratios of counts, so
they are compared to 1e-6 (the values are printed to 6 places).
"""

import json

import pytest

from selfevo.config import load_config
from selfevo.evolve import evolve

SCALED = ["world.name=small", "loop.admit_per_round=100", "loop.proposer_steps=6", "loop.solver_steps=5", "seed=0"]

# by round 1..3: oracle-audit A, T_P, F and admitted questions; macro Cover-EM after rounds 0..3;
# compute.json's counts
GOLDEN = {
    "coupled": {"A": [0.437624, 0.426, 0.406186], "T_P": [0.722772, 0.69, 0.71134],
        "F": [0.063366, 0.062, 0.03299], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.550571, 0.571857],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500},
        "updates": {"proposer": 18, "main": 15}},
    "crossfit": {"A": [0.437624, 0.338614, 0.442], "T_P": [0.722772, 0.653465, 0.75],
        "F": [0.063366, 0.047525, 0.082], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.55, 0.572714],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 1000},
        "updates": {"proposer": 18, "main": 15, "aux-0": 10, "aux-1": 10}},
    "msv": {"A": [0.469307, 0.490196, 0.526316], "T_P": [0.732673, 0.715686, 0.757895],
        "F": [0.077228, 0.1, 0.098947], "admitted": [46, 55, 53], "macro": [0.491, 0.528714, 0.536571, 0.543714],
        "generations": {"proposer": 306, "msv": 1836, "grader": 1530, "solver_rollouts": 770},
        "updates": {"proposer": 18, "main": 15}},
    "msv+crossfit": {"A": [0.469307, 0.459406, 0.492929], "T_P": [0.732673, 0.693069, 0.707071],
        "F": [0.077228, 0.108911, 0.147475], "admitted": [46, 49, 55], "macro": [0.491, 0.528714, 0.524857, 0.529143],
        "generations": {"proposer": 306, "msv": 1836, "grader": 1530, "solver_rollouts": 750, "aux_rollouts": 475},
        "updates": {"proposer": 18, "main": 15, "aux-0": 10, "aux-1": 10}},
    "question-split": {"A": [0.437624, 0.372277, 0.440816], "T_P": [0.722772, 0.70297, 0.683673],
        "F": [0.063366, 0.035644, 0.071429], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.536286, 0.573429],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 1000},
        "updates": {"proposer": 18, "main": 15, "aux-0": 10, "aux-1": 10}},
    "same-source": {"A": [0.437624, 0.411881, 0.437624], "T_P": [0.722772, 0.673267, 0.683168],
        "F": [0.063366, 0.063366, 0.085149], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.538143, 0.569857],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 1000},
        "updates": {"proposer": 18, "main": 15, "aux-0": 10, "aux-1": 10}},
    "full-data": {"A": [0.437624, 0.42, 0.45], "T_P": [0.722772, 0.67, 0.67],
        "F": [0.063366, 0.036, 0.098], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.552857, 0.567857],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 1000},
        "updates": {"proposer": 18, "main": 15, "aux-all": 10}},
    # half-budget updated 2026-12-07: its aux solvers' batches are drawn from the whole round, not its first ones
    "half-budget": {"A": [0.437624, 0.368317, 0.383673], "T_P": [0.722772, 0.693069, 0.785714],
        "F": [0.063366, 0.043564, 0.026531], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.547143, 0.576286],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 505},
        "updates": {"proposer": 18, "main": 15, "aux-0": 6, "aux-1": 4}},
    # crossfit-connected updated 2026-12-06 (twice): the link graph's clusters read the pages in id order (not the
    # world's); then selfevo's own Louvain (exact integer gains) in place of networkx's, whose clusters moved with
    # its version
    "crossfit-connected": {"A": [0.437624, 0.364356, 0.437113], "T_P": [0.722772, 0.683168, 0.773196],
        "F": [0.063366, 0.035644, 0.03299], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.537714, 0.553857],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 720},
        "updates": {"proposer": 18, "main": 15, "aux-0": 10, "aux-1": 10}},
    "crossfit-k3": {"A": [0.437624, 0.427451, 0.448], "T_P": [0.722772, 0.666667, 0.78],
        "F": [0.063366, 0.058824, 0.046], "admitted": [100, 100, 100], "macro": [0.491, 0.529, 0.544143, 0.563286],
        "generations": {"proposer": 306, "msv": 0, "grader": 1530, "solver_rollouts": 1500, "aux_rollouts": 1000},
        "updates": {"proposer": 18, "main": 15, "aux-0": 10, "aux-1": 10, "aux-2": 10}},
}


@pytest.mark.parametrize("treatment", sorted(GOLDEN))
def test_golden_numbers(tmp_path, treatment):
    evolve(load_config(None, [*SCALED, f"treatment={treatment}"]), tmp_path / "run", progress=False)
    run = tmp_path / "run"
    rounds = json.loads((run / "audit" / "metrics.json").read_text())["rounds"]
    got = {m: [r[m] for r in rounds] for m in ("A", "T_P", "F", "admitted")}
    got["macro"] = [json.loads((run / "eval" / f"round-{r}.json").read_text())["macro"]["cover_em"] for r in range(4)]
    compute = json.loads((run / "compute.json").read_text())
    want = GOLDEN[treatment]
    for key in ("A", "T_P", "F", "macro"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert got["admitted"] == want["admitted"]
    # the downstream evaluation, in every arm: the base model and 3 rounds, one trajectory a question
    want_generations = {**want["generations"], "evaluation": 4 * 1325}
    assert (compute["generations"], compute["updates"]) == (want_generations, want["updates"])
