"""Multi-turn search rollouts, written once for every language-model backend.

A backend supplies `generate(conversations, seed) -> [(text, finish_reason)]`, one assistant action
for each conversation (a local batched transformers model, vLLM, or an OpenAI-compatible endpoint);
this module runs the conversations to their end: each action is parsed, a search is answered with
the tool's passages, an invalid action gets the corrective message and a search past the budget the
budget-spent note (none of the three after the last allowed action: nothing would read them), and a
trajectory ends at its answer or after `max_actions` actions, or
at once, unanswered, when the backend reports the finish_reason "error" for it. Conversations still
running are generated together, so a batched backend keeps its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from selfevo.agents.lm.protocol import (
    BUDGET_SPENT,
    CORRECTIVE,
    Action,
    close_action,
    cut_at_stop,
    format_information,
    parse_action,
)
from selfevo.loop.schedule import derive_seed
from selfevo.search.tool import SearchTool

Generate = Callable[[list[list[dict]], int | None], list[tuple[str, str]]]


@dataclass
class Rollout:
    """One finished conversation. `messages` is the whole chat (system, user, assistant actions,
    observations as user turns): what training scores, with only the assistant turns trained."""

    messages: list[dict]
    answer: str = ""  # the content of the final <answer>, '' if none was given
    final: str = ""  # the whole text of the final assistant action ('' if it never answered)
    searches: list[str] = field(default_factory=list)  # the queries run (not a search on the last action)
    read: list[str] = field(default_factory=list)  # ids of the passages its searches returned
    actions: int = 0
    invalid: int = 0
    truncated: bool = False  # an action hit the token budget
    failed: bool = False  # the backend could not generate an action (finish_reason "error")

    @property
    def answered(self) -> bool:
        return bool(self.final)

    @property
    def last_action(self) -> str:
        """Its last assistant action as written (a search, where it never answered: `final` is then '')."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


def run_rollouts(starts: Sequence[list[dict]], tool: SearchTool, generate: Generate, *,
                 max_actions: int = 5, seed: int | None = None,
                 parse: Callable[[str], Action] = parse_action) -> list[Rollout]:
    """Run every conversation in `starts` to its end (see the module docstring)."""
    if max_actions < 1:
        raise ValueError(f"max_actions must be >= 1, got {max_actions}")
    rollouts = [Rollout([dict(m) for m in s]) for s in starts]
    active = list(range(len(starts)))
    for turn in range(max_actions):
        if not active:
            break
        replies = generate([rollouts[i].messages for i in active],
                           None if seed is None else derive_seed(seed, "turn", turn))
        if len(replies) != len(active):
            raise RuntimeError(f"generate returned {len(replies)} replies for {len(active)} conversations")
        # the searches of this turn go to the retriever as one batch
        pending: list[tuple[int, str]] = []
        still = []
        last = turn == max_actions - 1  # the trajectory ends after this action: nothing answers it
        for i, (text, finish) in zip(active, replies):
            ro = rollouts[i]
            if finish == "error":  # e.g. an API call that failed for good: end it, unanswered
                ro.failed = True
                continue
            text = cut_at_stop(close_action(text, finish))
            ro.messages.append({"role": "assistant", "content": text})
            ro.actions += 1
            ro.truncated |= finish == "length"
            action = parse(text)
            if action.kind == "answer":
                ro.answer, ro.final = action.content, text
                continue
            if action.kind == "search":
                pending.append((i, action.content))
            else:
                ro.invalid += 1
                if not last:
                    ro.messages.append({"role": "user", "content": CORRECTIVE})
            still.append(i)
        # one `tool.lookup` for them all: a dense encoder or a /retrieve server answers a batch in about
        # the time of one query (a session's search is one retriever call, one HTTP request, a query).
        # Each trajectory may make `tool.max_calls` searches, as a session allows.
        asked = []
        for i, query in pending:
            if last:
                # the trajectory ends here and nothing would read the pages (or the note), so the
                # retrieval is not made (verl's agent loop, too, ends at its last turn before any tool
                # call). The action stays in `messages`; `searches` and `read` hold what was run.
                continue
            if len(rollouts[i].searches) >= tool.max_calls:
                rollouts[i].messages.append({"role": "user", "content": BUDGET_SPENT})
            else:
                asked.append((i, query))
                rollouts[i].searches.append(query)
        for (i, _), hits in zip(asked, tool.lookup([q for _, q in asked]) if asked else [], strict=True):
            ro = rollouts[i]
            ro.read.extend(h.document.id for h in hits)
            ro.messages.append({"role": "user", "content": format_information(
                [(h.document.title, h.document.text) for h in hits])})
        active = still
    return rollouts
