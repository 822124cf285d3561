"""selfevo: self-evolving search agents without co-cheating, and the audit that measures it."""

__version__ = "0.1.0"
