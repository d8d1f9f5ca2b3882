"""Built-in task prompts for a per-category, single-stream speed table.

Decode speed can depend on what is generated (speculative decoding drafts code
and lists better than free prose; long prompts cost TTFT), so `trellm bench
serve --tasks` reports each category on its own. The prompts were written for
this project; they are plain chat messages with a natural ending, sent greedy.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskPrompt:
    category: str
    name: str
    message: str
    """The user message of a one-turn chat."""


def _tasks(category: str, *pairs: tuple[str, str]) -> tuple[TaskPrompt, ...]:
    return tuple(TaskPrompt(category, name, message) for name, message in pairs)


CODING = _tasks(
    "coding",
    ("fizzbuzz-variant",
     "Write a Python function `label(n)` that returns 'Tick' for multiples of 4, 'Tock' for "
     "multiples of 6, 'TickTock' for multiples of both, and the number as a string otherwise. "
     "Then show a loop printing the labels for 1 to 30."),
    ("merge-intervals",
     "In Python, write a function that takes a list of (start, end) integer pairs, merges every "
     "pair that overlaps or touches, and returns the merged list sorted by start. Add three short "
     "assertions that test it."),
    ("sql-report",
     "Given tables orders(id, customer_id, total, placed_at) and customers(id, name, country), "
     "write one SQL query that lists, for each country, the number of customers who placed at "
     "least two orders in 2024 and their average order total, highest average first."),
)

PROSE = _tasks(
    "prose",
    ("lighthouse",
     "Write a short story of about two paragraphs about a lighthouse keeper who finds that the "
     "lamp has started answering ships in a language nobody taught it."),
    ("market-morning",
     "Describe a fruit market in a small coastal town just after dawn, as the stalls open. Use "
     "concrete sounds and smells, and keep it to one paragraph."),
    ("letter",
     "Write a warm letter from a retired teacher to a former student who has just opened a "
     "bakery, mentioning a class project they both remember."),
)

REASONING = _tasks(
    "reasoning",
    ("trains",
     "A train leaves Town A at 9:00 travelling at 80 km/h towards Town B, 300 km away. Another "
     "leaves Town B at 10:00 travelling at 100 km/h towards Town A. At what time do they meet? "
     "Reason step by step."),
    ("boxes",
     "There are three boxes labelled 'apples', 'oranges' and 'mixed', and every label is wrong. "
     "You may take one fruit from one box without looking inside. Explain how to relabel all "
     "three boxes correctly."),
    ("ages",
     "Mira is twice as old as her brother was when Mira was as old as her brother is now. Their "
     "ages add up to 42. How old is each of them? Show the working."),
)

SUMMARY = _tasks(
    "summary",
    ("meeting-notes",
     "Summarise these meeting notes in three bullet points: The team agreed to move the release "
     "from March to April because the payment provider changed its API. Lena will update the "
     "integration and write migration notes. QA needs two extra weeks for regression testing on "
     "older phones. Marketing will delay the launch email, and support will prepare an FAQ about "
     "the new checkout screen. The budget is unchanged."),
    ("article",
     "Summarise in two sentences: Community gardens in several cities have turned vacant lots "
     "into shared plots where residents grow vegetables. Organisers say the gardens reduce "
     "litter, give older residents a reason to meet, and teach children where food comes from. "
     "Critics point out that many plots are on land leased for only a few years, so gardeners "
     "can lose years of work when a lease ends, and some cities have started offering longer "
     "leases in response."),
    ("support-ticket",
     "Summarise this support ticket for an engineer in one short paragraph: The customer says "
     "the mobile app logs them out every time they switch to another app and back. It started "
     "after yesterday's update. They use an older tablet, have reinstalled the app twice, and "
     "the web version works normally. They need it fixed before Friday's inventory count."),
)

FORMAT = _tasks(
    "format",
    ("json-record",
     "Return only a JSON object describing a fictional book with the keys title, author, year, "
     "genres (a list of two strings) and in_print (a boolean). No explanation."),
    ("markdown-table",
     "Make a markdown table with the columns Planet, Moons and Ring system for the four outer "
     "planets of the solar system. Output only the table."),
    ("csv-rows",
     "Write five CSV rows with a header line for a small shop inventory: item, quantity, "
     "unit_price. Use made-up items and output only the CSV."),
)

TASKS: tuple[TaskPrompt, ...] = CODING + PROSE + REASONING + SUMMARY + FORMAT
CATEGORIES: tuple[str, ...] = ("coding", "prose", "reasoning", "summary", "format")


def task_words() -> list[str]:
    """Every word of the task prompts: the vocabulary synthetic prompts are drawn from,
    so they read as English-like text rather than random token soup."""
    words: list[str] = []
    for t in TASKS:
        words.extend(w.strip(".,:;?!()'`\"") for w in t.message.split())
    return [w for w in words if w.isalpha()]
