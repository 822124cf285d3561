"""The language-model backend's pure parts: the Search-R1 / Dr. Zero text protocols, the rollout
driver (with a scripted generator), token masks and Equation (1)."""

from __future__ import annotations

import pytest
import torch

from selfevo.agents.lm import protocol as P
from selfevo.agents.lm.rl import (
    content_spans,
    sequence_pg_loss,
    token_logprobs,
    token_mask,
    trained_spans,
)
from selfevo.agents.lm.rollout import run_rollouts
from selfevo.records import Document
from selfevo.search.bm25 import BM25Index
from selfevo.search.tool import SearchTool

# ---------------------------------------------------------------- protocol


def test_parse_action_takes_the_first_closed_tag():
    assert P.parse_action("<think>hm</think><search> capital of France </search>") == P.Action(
        "search", "capital of France")
    assert P.parse_action("<think>x</think> <answer> Paris </answer> trailing") == P.Action("answer", "Paris")
    # generation may run past the stop string: only the first action counts
    assert P.parse_action("<search>a</search><answer>b</answer>") == P.Action("search", "a")
    assert P.parse_action("<answer>b</answer><search>a</search>") == P.Action("answer", "b")
    for bad in ("Paris", "<answer></answer>", "<search> unclosed", "", "<answer>  </answer>"):
        assert P.parse_action(bad).kind == "invalid", bad


def test_close_action_restores_a_dropped_stop_string():
    assert P.close_action("<think>x</think><search> q ", "stop") == "<think>x</think><search> q </search>"
    assert P.close_action("<answer> Paris", "stop") == "<answer> Paris</answer>"
    assert P.close_action("<answer> Paris", "length") == "<answer> Paris"  # truncated: not an action
    assert P.close_action("<answer>a</answer>", "stop") == "<answer>a</answer>"
    # a search left open, then an answer: the server stopped at "</answer>", which a local backend
    # keeps; both must read the answer
    left_open = "<think>hmm</think>\n<search> capital of France\n<answer> Paris "
    local = left_open + "</answer>"  # what a local backend keeps
    assert P.parse_action(P.cut_at_stop(local)) == P.Action("answer", "Paris")
    assert P.parse_action(P.cut_at_stop(P.close_action(left_open, "stop"))) == P.parse_action(P.cut_at_stop(local))
    assert P.close_action("<answer> x <search> q ", "stop") == "<answer> x <search> q </search>"


def test_format_information_truncates_passages():
    text = P.format_information([("T1", "one two three four"), ("T2", "x")], max_words=2)
    assert text == "<information>Doc 1 (Title: T1) one two ...\nDoc 2 (Title: T2) x</information>"


def test_hops_follow_the_4_3_2_1_ratio():
    n = 10_000
    counts = [0] * 4
    for i in range(n):
        counts[P.sample_hops((i + 0.5) / n) - 1] += 1
    assert counts == [4000, 3000, 2000, 1000]


def test_proposal_parsing_and_format_rules():
    q, a = P.parse_proposal("<think>..</think><question> Who wrote Hamlet? </question> <answer> Shakespeare </answer>")
    assert (q, a) == ("Who wrote Hamlet?", "Shakespeare")
    assert P.check_proposal(q, a) is None
    assert P.parse_proposal("<answer>x</answer><question>q</question>") == ("q", "")  # answer before question
    assert P.check_proposal("", "x") == "empty question"
    assert P.check_proposal("Who?", " ") == "empty answer"
    assert P.check_proposal("Who?", "...") == "empty answer"  # nothing left after normalisation
    assert P.check_proposal("Who?", "one two three four five six seven eight nine") == "long answer"
    assert P.check_proposal("Where is the Paris opera?", "paris") == "answer in question"
    assert P.check_proposal("Who founded Parisian cafes?", "Paris") is None  # a word, not a substring
    assert P.parse_proposer_action("<search> Hamlet author </search>") == P.Action("search", "Hamlet author")
    assert P.parse_proposer_action("<question>q</question><answer>a</answer>").kind == "answer"
    assert P.parse_proposer_action("<question>q</question> no answer yet").kind == "invalid"


# ---------------------------------------------------------------- the rollout driver


@pytest.fixture
def tool():
    docs = [Document("d1", "Hamlet", "Hamlet is a tragedy written by William Shakespeare."),
            Document("d2", "Paris", "Paris is the capital of France."),
            Document("d3", "Cairo", "The Nile flows through Cairo.")]
    return SearchTool(BM25Index.build(docs), topk=1, max_calls=2)


def test_rollouts_search_then_answer_with_what_was_found(tool):
    seen = []

    def generate(convs, seed):
        seen.append(len(convs))
        out = []
        for c in convs:
            last = c[-1]["content"]
            if "<information>" in last:  # answer with the title of the first passage found
                title = last.split("(Title: ")[1].split(")")[0]
                out.append((f"<think>found it</think><answer> {title} </answer>", "stop"))
            else:
                out.append(("<search> who wrote hamlet tragedy", "stop"))  # the API dropped </search>
        return out

    [ro] = run_rollouts([P.solver_messages("Who wrote Hamlet?")], tool, generate, max_actions=5, seed=1)
    assert ro.answer == "Hamlet" and ro.searches == ["who wrote hamlet tragedy"] and ro.read == ["d1"]
    assert ro.actions == 2 and ro.answered and not ro.truncated
    assert [m["role"] for m in ro.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert ro.messages[2]["content"].endswith("</search>")
    assert seen == [1, 1]


def test_invalid_actions_are_corrected_and_count_and_the_budget_holds(tool):
    def generate(convs, seed):
        out = []
        for c in convs:
            if c[-1]["content"] == P.CORRECTIVE:
                out.append(("<search> Paris </search>", "stop"))
            else:
                out.append(("I think it is Paris.", "stop"))
        return out

    [ro] = run_rollouts([P.solver_messages("q")], tool, generate, max_actions=5)
    # invalid, search, invalid, search, then the budget (2 searches) is spent
    assert ro.invalid == 3 and ro.actions == 5 and ro.answer == "" and not ro.answered
    assert len(ro.searches) == 2
    assert sum(m["content"] == P.CORRECTIVE for m in ro.messages) == 2  # none after the last action

    def always_search(convs, seed):
        return [("<search> Cairo </search>", "stop")] * len(convs)

    [ro] = run_rollouts([P.solver_messages("q")], tool, always_search, max_actions=4)
    assert len(ro.searches) == 2 and ro.actions == 4
    assert [m["content"] for m in ro.messages[-2:]] == [P.BUDGET_SPENT, "<search> Cairo </search>"]


def test_finished_conversations_leave_the_batch(tool):
    sizes = []

    def generate(convs, seed):
        sizes.append(len(convs))
        return [("<answer> x </answer>", "stop") if "early" in c[1]["content"] else ("<search> Nile </search>", "stop")
                for c in convs]

    ros = run_rollouts([P.solver_messages("early"), P.solver_messages("late")], tool, generate, max_actions=3)
    assert sizes == [2, 1, 1] and ros[0].actions == 1 and ros[1].actions == 3


# ---------------------------------------------------------------- masks and the loss


def chatml(ms):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ms)


MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"},
            {"role": "assistant", "content": "<search> q </search>"},
            {"role": "user", "content": "<information>doc</information>"},
            {"role": "assistant", "content": "<question> W? </question> <answer> A </answer>"}]


def test_content_spans_locate_each_message():
    rendered = [chatml(MESSAGES[:i + 1]) for i in range(len(MESSAGES))]
    spans = content_spans(rendered, MESSAGES)
    full = rendered[-1]
    assert [full[a:b] for a, b in spans] == [m["content"] for m in MESSAGES]


def test_trained_spans_mask_prompt_tools_and_the_proposers_answer():
    rendered = [chatml(MESSAGES[:i + 1]) for i in range(len(MESSAGES))]
    full = rendered[-1]
    spans = content_spans(rendered, MESSAGES)
    solver = [full[a:b] for a, b in trained_spans(MESSAGES, spans)]
    assert solver == ["<search> q </search>", "<question> W? </question> <answer> A </answer>"]
    proposer = [full[a:b] for a, b in trained_spans(MESSAGES, spans, mask_final_answer=True)]
    assert proposer == ["<search> q </search>", "<question> W? </question> "]


def test_token_mask_marks_tokens_wholly_inside_a_span():
    offsets = [(0, 3), (3, 5), (5, 9), (0, 0), (9, 12), (12, 14)]
    assert token_mask(offsets, [(3, 9), (12, 20)]) == [0, 1, 1, 0, 0, 1]
    assert token_mask(offsets, []) == [0] * 6
    assert token_mask([(0, 0), (0, 2)], [(0, 2)]) == [0, 1]  # a special token (empty span) never trains
    assert token_mask([(0, 4), (4, 7), (7, 9)], [(0, 5), (7, 9)]) == [1, 0, 1]  # straddling an edge: not trained


def test_token_logprobs_shift_by_one():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    ids = torch.tensor([[0, 1, 1]])
    lp = token_logprobs(logits, ids)
    assert torch.allclose(lp, torch.log(torch.tensor([[0.5, 0.1]])))


def test_sequence_pg_loss_is_equation_1():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -4.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    # seq 1: mean(-1,-2) = -1.5; seq 2: mean(-0.5,-4) = -2.25; L = -(2*-1.5 + -1*-2.25)/2
    assert sequence_pg_loss(lp, mask, adv).item() == pytest.approx(-(2 * -1.5 + -1 * -2.25) / 2)
    # G counts the whole batch when summed over micro-batches
    assert sequence_pg_loss(lp[:1], mask[:1], adv[:1], n_sequences=2).item() == pytest.approx(-(2 * -1.5) / 2)
    # an all-masked sequence contributes nothing (no division by zero)
    assert sequence_pg_loss(lp, torch.zeros_like(mask), adv).item() == 0.0
    # one trajectory as two rows (one an action): each divided by the trajectory's 4 trained tokens,
    # G = 1 trajectory: the mean over all four, (-1 - 2 - 0.5 - 4) / 4
    both = sequence_pg_loss(lp, mask, torch.tensor([2.0, 2.0]), n_sequences=1, denominators=torch.tensor([4, 4]))
    assert both.item() == pytest.approx(-2 * (-1 - 2 - 0.5 - 4) / 4)


def test_the_gradient_raises_rewarded_tokens_and_lowers_punished_ones():
    logits = torch.zeros(2, 3, 4, requires_grad=True)
    ids = torch.tensor([[0, 1, 2], [0, 1, 2]])
    mask = torch.tensor([[1, 1], [1, 1]])
    loss = sequence_pg_loss(token_logprobs(logits, ids), mask, torch.tensor([1.0, -1.0]))
    loss.backward()
    g = logits.grad
    # descending the loss moves a rewarded token's logit up, a punished one's down
    assert g[0, 0, 1] < 0 and g[0, 1, 2] < 0
    assert g[1, 0, 1] > 0 and g[1, 1, 2] > 0
    assert torch.all(g[:, 2] == 0)  # the last position predicts nothing inside the sequence
