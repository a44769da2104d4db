"""A multi-turn conversation (system, two user/assistant exchanges) shared by the data tests."""

CHAT = [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "I am fine."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
]
