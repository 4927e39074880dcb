"""Agent roles for the papers' workloads: short prompts a small instruct model follows.

Each role is an agent name (what the server keys private segments and
``out:<name>`` slots by), a title other agents see in front of its answer,
and a system prompt. The final agent reads the role agents' answers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str  # agent name in annotations; also the ``out:<name>`` slot of its answers
    title: str  # how other agents see it ("The math solver")
    system: str  # its system prompt


GSM8K_ROLES = (
    Role("solver", "The math solver",
         "You are a math solver. Solve the problem step by step with short sentences. "
         "End with 'The answer is N.' where N is a number."),
    Role("analyst", "The mathematical analyst",
         "You are a mathematical analyst. List the quantities in the problem, how they relate, "
         "then compute the result. End with 'The answer is N.' where N is a number."),
    Role("programmer", "The programming expert",
         "You are a programming expert. Reason about the problem as a small program: write the "
         "calculation as short Python expressions, evaluate them, and end with 'The answer is N.'"),
)
GSM8K_FINAL = Role("final", "The final agent",
                   "You are the final decision maker. Read the question and the team's answers, check "
                   "them, and give the correct result. End with 'The answer is N.' where N is a number.")
