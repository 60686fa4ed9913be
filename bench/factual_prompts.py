"""The yardstick's short factual chat check: a fixed neutral context and 20 questions.

Every question goes to the model as a chat (its chat template, a generation
prompt) after the same system message and the same few worked examples, so the
question sits after several hundred tokens of context: with a short prompt no KV
group would ever be quantized and every scheme would trivially answer as bf16
does. The context is neutral (unrelated to the questions, written for this
file); the examples only show the expected answer length. Each scheme's answer is
compared with bf16's answer (``bench.quality``, ``chat_same_as_bf16``). A small model
gets some of the questions wrong in bf16 too, and its answer to those flips with any
change of the cache; so every question also has an answer key (:data:`CHAT_KEYS`), and
the yardstick counts which answers are right and which of bf16's right answers a
scheme keeps (``chat_facts_kept``).
"""

from __future__ import annotations

import re

CHAT_SYSTEM = """\
You are a helpful assistant. Answer every question in a few words, without explanation.

Some background reading follows. It is not needed for the questions.

The town of Elmbridge lies on a slow river between two low hills. Its market opens every \
Saturday morning in the square in front of the old grain hall, where farmers from the \
surrounding villages sell apples, cheese, honey and bread. In spring the stalls are crowded \
with seedlings and cut flowers, and in autumn with pumpkins and jars of jam. A small brass band \
plays on the steps of the hall when the weather is fine.

The public library of Elmbridge was built more than a century ago with money raised by the \
townspeople. It has a reading room with tall windows, a children's corner with a wooden \
train, and a basement where old newspapers are kept in boxes. Volunteers repair damaged books \
on Tuesday evenings, and a reading group meets once a month to talk about a novel chosen by \
its members. The library also lends tools, board games and a telescope.

Walking paths leave the town in every direction. The river path follows the water past a \
weir, a mill that now houses a cafe, and a meadow where cattle graze in summer. The hill path \
climbs through a beech wood to a viewpoint with a bench and a map of the valley carved in \
stone. On clear days walkers can see the church towers of four villages and, far to the \
south, the line of the coast.

Most people in Elmbridge work in the town itself: in shops, in the school, at the clinic, or \
in the small workshops near the railway station that make furniture, bicycles and pottery. \
The train to the city takes forty minutes, and many students travel on it every day. In the \
evening the square is quiet, apart from the bakery, which starts work long before dawn.\
"""

#: worked examples (user, assistant) placed before every question, none of them asked
CHAT_EXAMPLES: tuple[tuple[str, str], ...] = (
    ("What is the capital of Spain?", "Madrid."),
    ("What is 2 plus 3?", "5."),
    ("What is the chemical symbol for oxygen?", "O."),
    ("Who wrote the Odyssey?", "Homer."),
)

#: the questions, in order; ``--quick`` asks the first few
CHAT_QUESTIONS: tuple[str, ...] = (
    "Name the largest planet of the solar system.",
    "What is the capital of France?",
    "What is the chemical symbol for gold?",
    "What is 7 times 8?",
    "Who wrote Romeo and Juliet?",
    "What is the capital of Japan?",
    "What is the chemical symbol for sodium?",
    "What is 15 plus 27?",
    "Who wrote Pride and Prejudice?",
    "How many continents are there on Earth?",
    "At what temperature in degrees Celsius does water boil at sea level?",
    "What is the capital of Italy?",
    "Which planet is known as the Red Planet?",
    "Which gas do plants take from the air for photosynthesis?",
    "What is the square root of 81?",
    "Who painted the Mona Lisa?",
    "What is the capital of Canada?",
    "What is the chemical symbol for iron?",
    "How many days are there in a leap year?",
    "What is the longest river in Africa?",
)

#: the accepted answers of each question (regular expressions, case-insensitive, matched
#: as whole words anywhere in the answer), in the order of :data:`CHAT_QUESTIONS`
CHAT_KEYS: tuple[tuple[str, ...], ...] = (
    ("Jupiter",), ("Paris",), ("Au",), ("56", "fifty-six"), ("Shakespeare",), ("Tokyo",),
    ("Na",), ("42", "forty-two"), ("Austen",), ("7", "seven"), ("100",), ("Rome",),
    ("Mars",), ("carbon dioxide", "CO2"), ("9", "nine"), ("Leonardo", "da Vinci"),
    ("Ottawa",), ("Fe",), ("366",), ("Nile",),
)


def answer_is_correct(question: int, answer: str) -> bool:
    """True when ``answer`` holds one of the accepted answers of question ``question``."""
    return any(re.search(rf"(?<!\w){key}(?!\w)", answer, re.IGNORECASE)
               for key in CHAT_KEYS[question])


def chat_messages(question: str) -> list[dict[str, str]]:
    """The chat of one question: the system message, the worked examples, the question."""
    msgs = [dict(role="system", content=CHAT_SYSTEM)]
    for q, a in CHAT_EXAMPLES:
        msgs += [dict(role="user", content=q), dict(role="assistant", content=a)]
    return msgs + [dict(role="user", content=question)]
