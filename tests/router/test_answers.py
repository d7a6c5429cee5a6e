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
    assert r.votes == (Vote("7", 3, (0, 3, 5), 3.0), Vote("8", 2, (2, 4), 2.0))


def test_majority_vote_tie_goes_to_first_seen_and_all_abstain_is_none():
    r = majority_vote([None, "b", "a", "a", "b"])
    assert (r.answer, r.best_branch) == ("b", 1)
    empty = majority_vote([None, None])
    assert (empty.answer, empty.votes, empty.best_branch) == (None, (), None)


def test_boxed_extractor_handles_nested_braces_and_takes_the_last():
    from thinkserve.router.answers import extract_boxed
    assert extract_boxed(r"so \boxed{3} or rather \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{42.0}") == "42"
    assert extract_boxed(r"\boxed{7} then \boxed{unclosed") == "7"
    assert extract_boxed("answer: 5") is None


def test_last_number_extractor_and_registry():
    import pytest

    from thinkserve.router.answers import extract_last_number, get_extractor
    assert extract_last_number("<think>3+4=7</think> so it is 1,024.") == "1024"
    assert extract_last_number("values 1,2 and -3.50") == "-3.5"
    assert extract_last_number("<think>12 steps so far") is None
    assert get_extractor("answer")("<think>x</think>answer: 8") == "8"
    with pytest.raises(ValueError, match="answer_extractor must be one of"):
        get_extractor("regex")


def test_weighted_vote_sums_weights_and_keeps_the_tie_break():
    r = majority_vote(["a", "b", "b"], [0.9, 0.4, 0.4])
    assert r.answer == "a" and r.votes[0].weight == 0.9 and r.votes[1].count == 2
    assert majority_vote(["b", "a"], [0.5, 0.5]).answer == "b"
