"""Chat prompts shared by the reference-fixture script and the end-to-end tests."""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Write a Python function that reverses a string."},
        {"role": "assistant", "content": "def reverse(s):\n    return s[::-1]"},
        {"role": "user", "content": "Now make it handle None — and emoji like 🙂 too."},
    ],
]
NUM_GREEDY_TOKENS = 32
