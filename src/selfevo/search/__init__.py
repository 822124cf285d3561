"""Search: retrievers (BM25 locally, any Search-R1 `/retrieve` server remotely) and the
budgeted search tool agents call."""

from selfevo.search.tool import Hit, Retriever, SearchBudgetExhausted, SearchSession, SearchTool

__all__ = ["Hit", "Retriever", "SearchBudgetExhausted", "SearchSession", "SearchTool"]
