"""The self-evolution engine: one loop, parameterised by its admission and feedback rules."""
