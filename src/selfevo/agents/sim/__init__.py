"""Fast numpy/pure-Python learners for the embedded world: real learners (policy gradient on
their own rollouts), small enough to run the paper's whole protocol in seconds."""

from selfevo.agents.sim.proposer import SimProposer, SimProposerConfig
from selfevo.agents.sim.reader import Reader
from selfevo.agents.sim.solver import SimSolver, SimSolverConfig

__all__ = ["Reader", "SimProposer", "SimProposerConfig", "SimSolver", "SimSolverConfig"]
