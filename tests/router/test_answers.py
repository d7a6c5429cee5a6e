from thinkserve.router import Vote, extract_answer, majority_vote, normalize_answer


def test_extracts_last_answer_line_after_reasoning():
    text = "<think>3+4 = 7, answer: 6? no\n</think>\nanswer: 7"
    assert extract_answer(text) == "7"
    assert extract_answer("Answer = 12.0\n") == "12"
    assert extract_answer("ANSWER:  -3.") == "-3"
    assert extract_answer("the answer: Paris") == "paris"
    assert extract_answer("answer: 1,024") == "1024"
    assert extract_answer("answer: 2.50") == "2.5"
    assert extract_answer("<think>7+8=15</think>answer: 85</s>") == "85"


def test_no_answer_or_unfinished_thinking_gives_none():
    assert extract_answer("") is None
    assert extract_answer("I think it is 7") is None
    assert extract_answer("<think>answer: 5 maybe") is None
    assert extract_answer("answer:   ") is None


def test_normalize_answer():
    assert normalize_answer(" 42 ") == "42"
    assert normalize_answer("42.") == "42"
    assert normalize_answer("+7") == "7"
    assert normalize_answer("x = 3") == "x = 3"


def test_majority_vote_counts_and_orders():
    r = majority_vote(["7", None, "8", "7", "8", "7"])
    assert r.answer == "7"
    assert r.best_branch == 0
    assert r.votes == (Vote("7", 3, (0, 3, 5)), Vote("8", 2, (2, 4)))


def test_majority_vote_tie_goes_to_first_seen_and_all_abstain_is_none():
    r = majority_vote([None, "b", "a", "a", "b"])
    assert (r.answer, r.best_branch) == ("b", 1)
    empty = majority_vote([None, None])
    assert (empty.answer, empty.votes, empty.best_branch) == (None, (), None)
