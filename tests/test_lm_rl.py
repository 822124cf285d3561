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


# ---------------------------------------------------------------- mutation sweep: protocol edges


def test_cut_at_stop_cuts_at_the_earliest_stop_string():
    # a local generation that ran past "</search>" into an answer keeps only the first action's text
    assert P.cut_at_stop("<search> a </search> <answer> b </answer>") == "<search> a </search>"
    assert P.cut_at_stop("<answer> b </answer> <search> a </search>") == "<answer> b </answer>"
    assert P.cut_at_stop("no stop here") == "no stop here"
    assert P.cut_at_stop("x</question> y", stops=("</question>",)) == "x</question>"


def test_the_action_is_read_from_the_text_cut_at_its_first_stop_string():
    # an answer whose text runs on to a closed search is the search: the first closing tag ends the action
    assert P.parse_action("<answer> x <search> q </search> y </answer>") == P.Action("search", "q")
    assert P.parse_action("<search> a <answer> b </answer> </search>") == P.Action("answer", "b")


def test_close_action_closes_only_a_reply_stopped_at_a_stop_string():
    for reason in ("length", "content_filter", "error"):
        assert P.close_action("<answer> Paris", reason) == "<answer> Paris"


def test_a_passage_of_exactly_max_words_is_not_marked_cut():
    text = P.format_information([("T", "one two")], max_words=2)
    assert text == "<information>Doc 1 (Title: T) one two</information>"
    long = " ".join(["w"] * (P.PASSAGE_WORDS + 1))
    assert P.format_information([("T", long)]).endswith(" ".join(["w"] * P.PASSAGE_WORDS) + " ...</information>")
    assert P.PASSAGE_WORDS == 100


def test_solver_messages_strip_the_question_and_put_the_document_first():
    [system, user] = P.solver_messages("  Who wrote Hamlet?\n")
    assert system["content"] == P.SOLVER_SYSTEM and user == {"role": "user", "content": "Question: Who wrote Hamlet?"}
    [_, user] = P.solver_messages("Who?", context="Alpha is a river.")
    assert user["content"] == "<document>\nAlpha is a river.\n</document>\nQuestion: Who?"
    # a question that holds the prefix itself reads back whole, from a message list or rendered text
    opening = P.solver_messages("Question: what is it?")
    assert P.solver_question(opening) == "Question: what is it?"
    assert P.solver_question("[system]...[user]Question: Question: what is it?") == "Question: what is it?"


def test_the_proposers_action_edges():
    # a search written after the question is no search, and an <answer> left open is no final turn
    assert P.parse_proposer_action("<question> Who? </question> <search> x </search>").kind == "invalid"
    assert P.parse_proposer_action("<question> Who? </question> <answer> Ann").kind == "invalid"
    # the longest short answer passes; one word more is long
    eight = "one two three four five six seven eight"
    assert P.check_proposal("Who?", eight) is None
    assert P.check_proposal("Who?", eight + " nine") == "long answer"
    # a final turn without a question breaks the format rules; only no final turn at all is "no final question"
    assert P.read_proposal("<answer> Ann </answer>") == ("", "Ann", "empty question")
    assert P.read_proposal("")[2] == "no final question"


# ---------------------------------------------------------------- mutation sweep: the rollout driver


def test_run_rollouts_refuses_no_actions_and_a_short_reply_list(tool):
    with pytest.raises(ValueError, match="max_actions must be >= 1, got 0"):
        run_rollouts([P.solver_messages("q")], tool, lambda convs, s: [], max_actions=0)
    with pytest.raises(RuntimeError, match="generate returned 1 replies for 2 conversations"):
        run_rollouts([P.solver_messages("a"), P.solver_messages("b")], tool,
                     lambda convs, s: [("<answer> x </answer>", "stop")])


def test_each_turn_samples_with_a_seed_of_its_own(tool):
    from selfevo.loop.schedule import derive_seed

    seeds = []

    def generate(convs, seed):
        seeds.append(seed)
        return [("<search> Nile </search>", "stop") if len(seeds) == 1 else ("<answer> Cairo </answer>", "stop")]

    run_rollouts([P.solver_messages("q")], tool, generate, max_actions=3, seed=7)
    assert seeds == [derive_seed(7, "turn", 0), derive_seed(7, "turn", 1)] and seeds[0] != seeds[1]
    seeds.clear()
    run_rollouts([P.solver_messages("q")], tool, generate, max_actions=3)
    assert seeds == [None, None]


def test_a_rollout_cut_once_stays_truncated_and_keeps_its_whole_final_action(tool):
    replies = iter([("<think>long", "length"), ("<think>ok</think><answer> Paris </answer>", "stop")])
    [ro] = run_rollouts([P.solver_messages("q")], tool, lambda convs, s: [next(replies)], max_actions=3)
    assert ro.truncated and ro.invalid == 1 and ro.answer == "Paris"
    assert ro.final == "<think>ok</think><answer> Paris </answer>" == ro.last_action
    # an unanswered rollout's last action is the latest one it wrote
    replies = iter([("<search> Nile </search>", "stop"), ("<search> Cairo </search>", "stop")])
    [ro] = run_rollouts([P.solver_messages("q")], tool, lambda convs, s: [next(replies)], max_actions=2)
    assert ro.final == "" and ro.last_action == "<search> Cairo </search>"


# ---------------------------------------------------------------- mutation sweep: masks


def test_content_spans_take_the_latest_occurrence_of_a_message():
    # the action repeats the question word for word: its span is its own turn, not the user's
    ms = [{"role": "system", "content": "S"}, {"role": "user", "content": "Paris"},
          {"role": "assistant", "content": "Paris"}]
    rendered = [chatml(ms[:i + 1]) for i in range(3)]
    spans = content_spans(rendered, ms)
    assert spans[2][0] == len(chatml(ms[:2])) + len("<|im_start|>assistant\n")
    assert [rendered[-1][a:b] for a, b in spans] == ["S", "Paris", "Paris"]


def test_only_the_last_assistant_messages_answer_is_cut_for_the_proposer():
    ms = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<answer> early </answer>"},
          {"role": "user", "content": "note"},
          {"role": "assistant", "content": "<question> W? </question> <answer> A </answer>"}]
    rendered = [chatml(ms[:i + 1]) for i in range(len(ms))]
    spans = trained_spans(ms, content_spans(rendered, ms), mask_final_answer=True)
    assert [rendered[-1][a:b] for a, b in spans] == ["<answer> early </answer>", "<question> W? </question> "]


def test_token_mask_trains_tokens_in_adjacent_and_unsorted_spans():
    assert token_mask([(0, 1), (1, 2), (2, 3)], [(0, 1), (1, 2)]) == [1, 1, 0]
    assert token_mask([(0, 2), (2, 4), (4, 6)], [(4, 6), (0, 2)]) == [1, 0, 1]


def test_content_spans_refuse_a_message_found_only_inside_the_previous_one():
    # a template that does not render assistant turns: "world" is found, but in the user's turn
    def no_assistant(ms):
        return "".join(f"<{m['role']}>{m['content'] if m['role'] == 'user' else ''}</s>" for m in ms)

    ms = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "world"}]
    with pytest.raises(ValueError, match=r"message 1: content not found after the previous message"):
        content_spans([no_assistant(ms[:i + 1]) for i in range(2)], ms)


def test_the_proposers_final_answer_is_cut_across_lines():
    ms = [*MESSAGES[:4], {"role": "assistant", "content": "<question> W? </question> <answer> Ann\nLee </answer>"}]
    rendered = [chatml(ms[:i + 1]) for i in range(len(ms))]
    spans = trained_spans(ms, content_spans(rendered, ms), mask_final_answer=True)
    assert [rendered[-1][a:b] for a, b in spans] == ["<search> q </search>", "<question> W? </question> "]


def test_a_scaffolded_question_the_backend_failed_is_not_continued():
    calls = []

    def gen(convs, seed, prefix=None, stops=()):
        calls.append(list(prefix))
        return [("", "error"), (prefix[1] + " Who?</question>", "stop")] if len(calls) == 1 else [
            (prefix[0] + " Ann</answer>", "stop")]

    out = P.scaffolded(gen)([[{"role": "user", "content": "doc"}]] * 2, 0)
    assert calls[1] == ["<question> Who?</question> <answer>"]  # only the whole question goes on
    assert out == [("", "error"), ("<question> Who?</question> <answer> Ann</answer>", "stop")]


# ---------------------------------------------------------------- pinned by a mutation sweep (forty-sixth session)


def test_the_proposers_final_action_has_each_answer_cut_and_the_text_between_them_trained():
    ms = [*MESSAGES[:4], {"role": "assistant", "content": "<question> W? </question> <answer> A </answer> or "
                                                         "<answer> B </answer>."}]
    rendered = [chatml(ms[:i + 1]) for i in range(len(ms))]
    spans = trained_spans(ms, content_spans(rendered, ms), mask_final_answer=True)
    assert [rendered[-1][a:b] for a, b in spans] == ["<search> q </search>", "<question> W? </question> ", " or ", "."]


def test_content_spans_keep_an_actions_whitespace_where_it_follows_the_previous_message_directly():
    # a template with nothing between messages: " A " starts right where "Q" ends, as rendered, whitespace and all
    ms = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": " A "}]
    rendered = ["Q", "Q A "]
    assert content_spans(rendered, ms) == [(0, 1), (1, 4)]


def test_template_of_passes_its_settings_to_the_chat_template():
    from selfevo.agents.lm.rl import template_of

    seen = []

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kwargs):
            seen.append((tokenize, add_generation_prompt, kwargs))
            return "text"

    render = template_of(Tokenizer(), enable_thinking=False)
    assert render([{"role": "user", "content": "q"}], True) == "text"
    render([{"role": "user", "content": "q"}])
    assert seen == [(False, True, {"enable_thinking": False}), (False, False, {"enable_thinking": False})]


def test_content_spans_find_a_trimmed_action_in_its_own_turn_not_in_an_earlier_one():
    # a trimming template (Llama 3's `| trim`) and an action that repeats the user's words: the stripped action
    # is looked for from the end, so it is found in its own turn (from the start it lay before the user's end)
    def trimming(ms):
        return "".join(f"<{m['role']}>{m['content'].strip()}</s>" for m in ms)

    ms = [{"role": "user", "content": "Paris"}, {"role": "assistant", "content": " Paris"}]
    rendered = [trimming(ms[:i + 1]) for i in range(2)]
    spans = content_spans(rendered, ms)
    assert spans[1] == (len("<user>Paris</s><assistant>"), len("<user>Paris</s><assistant>Paris"))


def test_a_reply_that_ran_past_its_stop_string_is_recorded_cut_and_a_cut_short_one_counts_as_an_action(tool):
    replies = iter([("<search> Nile </search> <answer> Cairo </answer>", "stop"), ("<think>long", "length"),
                    ("<answer> Cairo </answer> more", "stop")])
    [ro] = run_rollouts([P.solver_messages("q")], tool, lambda convs, s: [next(replies)], max_actions=3)
    assert [m["content"] for m in ro.messages if m["role"] == "assistant"] == [
        "<search> Nile </search>", "<think>long", "<answer> Cairo </answer>"]
    assert ro.actions == 3 and ro.invalid == 1 and ro.truncated and ro.final == "<answer> Cairo </answer>"


def test_content_spans_refuse_a_template_that_rewrites_an_earlier_messages_own_text():
    # the text before the action is unchanged, but the action itself is rendered otherwise once a turn follows
    def shouting_earlier(ms):
        return "".join(f"<{m['role']}>{m['content'].upper() if i < len(ms) - 1 else m['content']}</s>"
                       for i, m in enumerate(ms))

    ms = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "abc"}, {"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match=r"message 1 \(assistant\): the chat template renders"):
        content_spans([shouting_earlier(ms[:i + 1]) for i in range(3)], ms)
