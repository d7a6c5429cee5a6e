"""tiny-reasoner: the small Llama-architecture reasoning model this project trains and ships.

``tasks`` defines the problems, chains and answer parsing (pure Python); ``tokenizer_build``
writes its tokenizer; ``train`` trains it. The shipped weights live in ``workers/models/tiny_reasoner/``.
"""
from .tasks import LEVELS, REALISTIC_MIX, Level, Problem, generate_problems, parse_answer, prompt_for, solution_for

__all__ = ["LEVELS", "REALISTIC_MIX", "Level", "Problem", "generate_problems", "parse_answer", "prompt_for", "solution_for"]
