"""The Search-R1 search environment for verl's multi-turn agent loop.

verl (0.9) runs multi-turn rollouts in an agent loop (`ToolAgentLoop`) that parses tool calls with a
registered parser, executes `BaseTool` subclasses named in a tool config YAML, appends their
responses as tool turns (response_mask 0: never trained), and stops at the first reply without a
call. The Search-R1 protocol writes calls as text tags, so selfevo registers three small pieces:

    SearchR1ToolParser  format "search_r1": `<search> q </search>` -> a call of the `search` tool
    SearchR1Tool        the tool: POST the query to a Search-R1 `/retrieve` server (`selfevo
                        serve-retriever`), answer `<information>Doc 1 (Title: …) …</information>`
                        (`protocol.format_information`), enforce the per-trajectory search budget,
                        and note the pages read in `extra_fields["selfevo_read"]` (the proposal's
                        lineage, which verl hands the reward function in `extra_info`)
    SearchR1AgentLoop   agent "search_r1_agent": verl's ToolAgentLoop with vLLM stop strings
                        `</search>`, `</answer>` kept in the output, so one generation is one action

`tool_config()` and `agent_loop_config()` write the YAML verl reads; `verl_launch.py` writes the
launch command. The classes exist only where verl imports; the protocol pieces they use are the
pure functions below (tested without verl).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from selfevo.agents.lm.protocol import BUDGET_SPENT, STOP_STRINGS, cut_at_stop, format_information, parse_action
from selfevo.search.client import TIMEOUT_S

TOOL_NAME = "search"
PARSER_NAME = "search_r1"
AGENT_NAME = "search_r1_agent"
TOOL_CLASS = "selfevo.integrations.verl_search.SearchR1Tool"
AGENT_CLASS = "selfevo.integrations.verl_search.SearchR1AgentLoop"

TOOL_SCHEMA = {"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Search the corpus; the top passages come back between <information> and </information>.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "the search query"}},
                   "required": ["query"]}}}


# ---------------------------------------------------------------- pure pieces


def parse_search_call(text: str) -> tuple[str, str | None]:
    """`(content, query)`: the action's text up to its first stop string, and the query when the
    action is a search (None for an answer or an invalid action)."""
    text = cut_at_stop(text)
    action = parse_action(text)
    return text, (action.content if action.kind == "search" else None)


def search_response(retriever, query: str, topk: int) -> tuple[str, list[str]]:
    """The observation for one search and the ids of the passages it returned."""
    hits = retriever.retrieve([query], topk=topk)[0]
    return format_information([(h.document.title, h.document.text) for h in hits]), [h.document.id for h in hits]


def tool_config(retriever_url: str, topk: int = 3, max_calls: int = 5, timeout: float = TIMEOUT_S) -> dict:
    """verl's tool config (actor_rollout_ref.rollout.multi_turn.tool_config_path)."""
    return {"tools": [{"class_name": TOOL_CLASS,
                       "config": {"type": "native", "retrieval_service_url": retriever_url, "topk": topk,
                                  "max_calls": max_calls, "timeout": timeout},
                       "tool_schema": TOOL_SCHEMA}]}


def agent_loop_config() -> list[dict]:
    """verl's agent loop config (actor_rollout_ref.rollout.agent.agent_loop_config_path)."""
    return [{"name": AGENT_NAME, "_target_": AGENT_CLASS}]


def write_yaml(obj, path) -> None:
    import yaml

    from selfevo._io import atomic_writer

    with atomic_writer(path) as fh:
        yaml.safe_dump(obj, fh, sort_keys=False)


# ---------------------------------------------------------------- verl classes

try:  # verl is an optional engine: the classes exist only where it imports
    from verl.experimental.agent_loop.agent_loop import register as _register_agent
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall as _FunctionCall
    from verl.experimental.agent_loop.tool_parser import ToolParser as _ToolParser
    from verl.tools.base_tool import BaseTool as _BaseTool
    from verl.tools.schemas import ToolResponse as _ToolResponse

    HAVE_VERL = True
except ImportError:  # pragma: no cover - exercised where verl is absent
    HAVE_VERL = False

if HAVE_VERL:

    @_ToolParser.register(PARSER_NAME)
    class SearchR1ToolParser(_ToolParser):
        """`<search> q </search>` -> one call of the search tool; anything else ends the turn."""

        async def extract_tool_calls(self, responses_ids: Sequence[int], tools=None):
            import asyncio

            text = await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.decode, responses_ids)
            content, query = parse_search_call(text)
            if query is None:
                return content, []
            return content, [_FunctionCall(name=TOOL_NAME, arguments=json.dumps({"query": query}, ensure_ascii=False))]

    class SearchR1Tool(_BaseTool):
        """The search tool over a Search-R1 `/retrieve` server (see the module docstring)."""

        def __init__(self, config: dict, tool_schema=None):
            from verl.tools.schemas import OpenAIFunctionToolSchema

            from selfevo.search.client import RetrieverClient

            super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA))
            self.topk, self.max_calls = int(config.get("topk", 3)), int(config.get("max_calls", 5))
            self.client = RetrieverClient(config["retrieval_service_url"],
                                          timeout=float(config.get("timeout", TIMEOUT_S)))

        async def execute(self, instance_id: str, parameters: dict, **kwargs):
            import asyncio

            agent_data = kwargs.get("agent_data")
            extra = agent_data.extra_fields if agent_data is not None else {}
            used = int(extra.get("selfevo_searches", 0))
            if used >= self.max_calls:
                return _ToolResponse(text=BUDGET_SPENT), 0.0, {"budget_spent": 1}
            query = str(parameters.get("query", "")).strip()
            text, ids = await asyncio.get_running_loop().run_in_executor(
                None, search_response, self.client, query, self.topk)
            extra["selfevo_searches"] = used + 1
            extra["selfevo_read"] = list(dict.fromkeys([*extra.get("selfevo_read", []), *ids]))
            return _ToolResponse(text=text), 0.0, {"passages": len(ids)}

    @_register_agent(AGENT_NAME)
    class SearchR1AgentLoop(_ToolAgentLoop):
        """verl's tool agent loop, one action per generation: vLLM stops at `</search>` / `</answer>`."""

        async def _handle_generating_state(self, agent_data, sampling_params, ignore_termination: bool = False):
            params = {**sampling_params, "stop": list(STOP_STRINGS), "include_stop_str_in_output": True}
            return await super()._handle_generating_state(agent_data, params, ignore_termination)
